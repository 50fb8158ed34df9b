//! LIST as kube-apiserver serves it: pages (`limit`, `continue`) at one revision, the
//! watch cache's rule for `resourceVersion=0`, exact and not-older-than reads, expired
//! and malformed tokens (`paging.rs`), and label and field selectors parsed as upstream
//! parses them (`selectors.rs`). Each test names the upstream file it follows.

mod common;

use common::{client, http};
use faultline_test_apiserver::{spawn, ApiServer};
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Event, Node, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams, WatchParams};
use serde_json::{json, Value};

fn cm(name: &str, v: &str) -> Value {
    json!({"metadata": {"name": name}, "data": {"v": v}})
}

fn names(list: &Value) -> Vec<String> {
    list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["metadata"]["name"].as_str().unwrap().to_string())
        .collect()
}

async fn seed(n: usize) -> (ApiServer, String) {
    let (s, url) = spawn().await;
    for i in 0..n {
        s.create("configmaps", "default", cm(&format!("cm-{i}"), "0"))
            .unwrap();
    }
    (s, url)
}

/// staging/src/k8s.io/apiserver/pkg/storage/etcd3/store.go `GetList` (and cacher.go for
/// a consistent read with a limit): at most `limit` items, a continue token and
/// `remainingItemCount`; the token resumes at the first page's revision, so writes made
/// in between are not seen until a new list.
#[tokio::test]
async fn limit_pages_a_list_and_continue_resumes_at_its_revision() {
    let (s, url) = seed(5).await;
    let cms: Api<ConfigMap> = Api::namespaced(client(&url), "default");
    let first = cms.list(&ListParams::default().limit(2)).await.unwrap();
    let page = |l: &kube::api::ObjectList<ConfigMap>| {
        l.items
            .iter()
            .map(|c| {
                format!(
                    "{}={}",
                    c.metadata.name.clone().unwrap(),
                    c.data.as_ref().unwrap()["v"]
                )
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(page(&first), ["cm-0=0", "cm-1=0"]);
    assert_eq!(first.metadata.remaining_item_count, Some(3));
    let rv = first.metadata.resource_version.clone().unwrap();
    let token = first.metadata.continue_.clone().unwrap();
    assert!(!token.is_empty());

    // Between the pages: a new object, a change and a removal.
    s.create("configmaps", "default", cm("cm-2a", "0")).unwrap();
    cms.patch(
        "cm-3",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"v": "1"}})),
    )
    .await
    .unwrap();
    s.delete("configmaps", "default", "cm-4").unwrap();

    let second = cms
        .list(&ListParams::default().limit(2).continue_token(&token))
        .await
        .unwrap();
    assert_eq!(page(&second), ["cm-2=0", "cm-3=0"], "as at the first page");
    assert_eq!(second.metadata.resource_version.as_deref(), Some(&*rv));
    assert_eq!(second.metadata.remaining_item_count, Some(1));
    let third = cms
        .list(
            &ListParams::default()
                .limit(2)
                .continue_token(second.metadata.continue_.as_deref().unwrap()),
        )
        .await
        .unwrap();
    assert_eq!(page(&third), ["cm-4=0"]);
    assert!(third.metadata.continue_.as_deref().unwrap_or("").is_empty());
    assert_eq!(third.metadata.remaining_item_count, None);

    let now = cms.list(&ListParams::default()).await.unwrap();
    assert_eq!(
        page(&now),
        ["cm-0=0", "cm-1=0", "cm-2=0", "cm-2a=0", "cm-3=1"]
    );
    assert_ne!(now.metadata.resource_version.as_deref(), Some(&*rv));
}

/// staging/src/k8s.io/apiserver/pkg/storage/cacher/cacher.go `computeListLimit`: "the
/// limit is ignored for requests that set RV == 0" (the watch cache answers them
/// whole), while any other resourceVersion honours it.
#[tokio::test]
async fn resource_version_zero_ignores_the_limit() {
    let (_s, url) = seed(5).await;
    let path = "/api/v1/namespaces/default/configmaps";
    let whole = http(
        &url,
        "GET",
        &format!("{path}?limit=2&resourceVersion=0"),
        None,
    )
    .await;
    assert_eq!(whole.status, 200);
    let whole = whole.json();
    assert_eq!(names(&whole).len(), 5);
    assert!(whole["metadata"].get("continue").is_none());
    let paged = http(
        &url,
        "GET",
        &format!("{path}?limit=2&resourceVersion=1&resourceVersionMatch=NotOlderThan"),
        None,
    )
    .await
    .json();
    assert_eq!(names(&paged), ["cm-0", "cm-1"]);
    assert!(paged["metadata"]["continue"].is_string());
}

/// A lagging watch cache (`Faults::stale_list_ms`): a list at `resourceVersion=0` may
/// show the state of an earlier revision (what a cached list is allowed to show, and
/// what a controller reading from the cache must live with), its own resourceVersion
/// that revision; a consistent read, and a list not older than the newest revision,
/// never do.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_lagging_watch_cache_serves_lists_of_the_past() {
    // On a virtual clock: the change comes 300 ms after the creation without waiting.
    let (s, url) = faultline_test_apiserver::Bootstrap::new()
        .virtual_time(1_767_225_600_000)
        .spawn()
        .await;
    s.create("configmaps", "default", cm("cm-0", "0")).unwrap();
    let first = s.get("configmaps", "default", "cm-0").unwrap()["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_string();
    tokio::time::advance(std::time::Duration::from_millis(300)).await;
    s.update("configmaps", "default", "cm-0", cm("cm-0", "1"), None)
        .unwrap();
    let newest = s.get("configmaps", "default", "cm-0").unwrap()["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_string();
    s.set_faults(faultline_test_apiserver::Faults {
        stale_list_ms: 10_000,
        seed: 7,
        ..Default::default()
    });
    let path = "/api/v1/namespaces/default/configmaps";
    let state = |l: &Value| -> (Vec<String>, String) {
        let vs = l["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["data"]["v"].as_str().unwrap().to_string())
            .collect();
        (
            vs,
            l["metadata"]["resourceVersion"]
                .as_str()
                .unwrap()
                .to_string(),
        )
    };
    let mut stale = 0;
    for _ in 0..20 {
        let (vs, rv) = state(
            &http(&url, "GET", &format!("{path}?resourceVersion=0"), None)
                .await
                .json(),
        );
        match vs.as_slice() {
            [v] if v == "1" => assert_eq!(rv, newest),
            [v] if v == "0" => {
                assert_eq!(rv, first, "the state at cm-0's creation");
                stale += 1;
            }
            [] => stale += 1,
            other => panic!("a state that never was: {other:?} at {rv}"),
        }
        let (vs, rv) = state(&http(&url, "GET", path, None).await.json());
        assert_eq!(
            (vs, rv),
            (vec!["1".to_string()], newest.clone()),
            "a consistent read"
        );
        let q = format!("{path}?resourceVersion={newest}&resourceVersionMatch=NotOlderThan");
        let (vs, _) = state(&http(&url, "GET", &q, None).await.json());
        assert_eq!(vs, ["1"], "not older than the newest revision");
    }
    assert!(stale > 0, "no list of 20 came from the past");
}

/// etcd3/store.go: a non-zero resourceVersion with a limit (legacy) or with
/// `resourceVersionMatch=Exact` reads exactly that revision; NotOlderThan reads the
/// newest; the cacher's "Too large resource version" (504) and etcd's future revision
/// (500) for a revision not reached; etcd3/errors.go's 410 once compacted.
#[tokio::test]
async fn exact_resource_versions_list_the_past_until_compacted() {
    let (s, url) = seed(3).await;
    let path = "/api/v1/namespaces/default/configmaps";
    let then = http(&url, "GET", path, None).await.json()["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_string();
    s.create("configmaps", "default", cm("cm-9", "0")).unwrap();
    s.delete("configmaps", "default", "cm-0").unwrap();
    let mut changed = s.get("configmaps", "default", "cm-1").unwrap();
    changed["data"]["v"] = json!("1");
    s.update("configmaps", "default", "cm-1", changed, None)
        .unwrap();

    for q in [
        format!("limit=10&resourceVersion={then}"),
        format!("resourceVersion={then}&resourceVersionMatch=Exact"),
    ] {
        let past = http(&url, "GET", &format!("{path}?{q}"), None).await.json();
        assert_eq!(names(&past), ["cm-0", "cm-1", "cm-2"], "{q}");
        assert_eq!(past["items"][1]["data"]["v"], "0", "{q}");
        assert_eq!(past["metadata"]["resourceVersion"], then.as_str(), "{q}");
    }
    let newest = http(
        &url,
        "GET",
        &format!("{path}?resourceVersion={then}&resourceVersionMatch=NotOlderThan"),
        None,
    )
    .await
    .json();
    assert_eq!(names(&newest), ["cm-1", "cm-2", "cm-9"]);

    let too_large = http(&url, "GET", &format!("{path}?resourceVersion=99999"), None).await;
    assert_eq!(too_large.status, 504);
    let body = too_large.json();
    assert_eq!(
        body["details"]["causes"][0]["reason"],
        "ResourceVersionTooLarge"
    );
    let future = http(
        &url,
        "GET",
        &format!("{path}?limit=1&resourceVersion=99999"),
        None,
    )
    .await;
    assert_eq!(future.status, 500);

    s.compact();
    let gone = http(
        &url,
        "GET",
        &format!("{path}?limit=1&resourceVersion={then}"),
        None,
    )
    .await;
    assert_eq!(gone.status, 410);
    let body = gone.json();
    assert_eq!(body["reason"], "Expired");
    assert_eq!(
        body["message"],
        "The resourceVersion for the provided list is too old."
    );
}

/// etcd3/errors.go `handleCompactedErrorForPaging`: a token older than the history is
/// a 410 whose Status carries a token at the latest revision; continue.go
/// `DecodeContinue` and etcd3/store.go: a malformed token, or a resourceVersion with a
/// token, is a 400; validation.go `ValidateListOptions`: a resourceVersionMatch without
/// a resourceVersion is a 422.
#[tokio::test]
async fn expired_and_malformed_continue_tokens() {
    let (s, url) = seed(3).await;
    let path = "/api/v1/namespaces/default/configmaps";
    let first = http(&url, "GET", &format!("{path}?limit=1"), None)
        .await
        .json();
    let token = first["metadata"]["continue"].as_str().unwrap().to_string();
    s.create("configmaps", "default", cm("cm-3", "0")).unwrap();
    s.create("configmaps", "default", cm("cm-4", "0")).unwrap();
    s.compact();
    let gone = http(
        &url,
        "GET",
        &format!("{path}?limit=1&continue={token}"),
        None,
    )
    .await;
    assert_eq!(gone.status, 410);
    let status = gone.json();
    assert_eq!(status["reason"], "Expired");
    assert!(status["message"]
        .as_str()
        .unwrap()
        .starts_with("The provided continue parameter is too old"));
    let fresh = status["metadata"]["continue"].as_str().unwrap();
    let rest = http(&url, "GET", &format!("{path}?continue={fresh}"), None)
        .await
        .json();
    assert_eq!(
        names(&rest),
        ["cm-1", "cm-2", "cm-3", "cm-4"],
        "the new token continues at the latest revision"
    );

    let bad = http(
        &url,
        "GET",
        &format!("{path}?limit=1&continue=bm90LWpzb24"),
        None,
    )
    .await;
    assert_eq!(bad.status, 400);
    assert!(bad.json()["message"]
        .as_str()
        .unwrap()
        .starts_with("invalid continue token: continue key is not valid"));
    let first = http(&url, "GET", &format!("{path}?limit=1"), None)
        .await
        .json();
    let token = first["metadata"]["continue"].as_str().unwrap();
    let with_rv = http(
        &url,
        "GET",
        &format!("{path}?limit=1&continue={token}&resourceVersion=5"),
        None,
    )
    .await;
    assert_eq!(with_rv.status, 400);
    assert_eq!(
        with_rv.json()["message"],
        "specifying resource version is not allowed when using continue"
    );
    let no_rv = http(
        &url,
        "GET",
        &format!("{path}?resourceVersionMatch=Exact"),
        None,
    )
    .await;
    assert_eq!(no_rv.status, 422);
    assert!(no_rv.json()["message"]
        .as_str()
        .unwrap()
        .contains("resourceVersionMatch is forbidden unless resourceVersion is provided"));
}

/// etcd3/store.go: with selectors a page may hold fewer items than the limit and the
/// count of what remains is omitted (`remainingItemCount` only for an empty
/// predicate); keys are in etcd's byte order, `ns-2/x` before `ns/y` across namespaces.
#[tokio::test]
async fn selected_pages_omit_the_count_and_keys_keep_etcds_order() {
    let (s, url) = spawn().await;
    for i in 0..6 {
        let mut o = cm(&format!("cm-{i}"), "0");
        o["metadata"]["labels"] = json!({"pick": if i % 2 == 0 { "yes" } else { "no" }});
        s.create("configmaps", "default", o).unwrap();
    }
    let cms: Api<ConfigMap> = Api::namespaced(client(&url), "default");
    let mut seen = Vec::new();
    let mut lp = ListParams::default().labels("pick=yes").limit(2);
    loop {
        let page = cms.list(&lp).await.unwrap();
        assert_eq!(page.metadata.remaining_item_count, None);
        seen.extend(page.items.iter().map(|c| c.metadata.name.clone().unwrap()));
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(c) => lp = lp.continue_token(&c),
            None => break,
        }
    }
    assert_eq!(seen, ["cm-0", "cm-2", "cm-4"]);

    for ns in ["ns", "ns-2"] {
        s.create("namespaces", "", json!({"metadata": {"name": ns}}))
            .unwrap();
    }
    s.create("configmaps", "ns", cm("y", "0")).unwrap();
    s.create("configmaps", "ns-2", cm("x", "0")).unwrap();
    let all = http(
        &url,
        "GET",
        "/api/v1/configmaps?fieldSelector=metadata.namespace!%3Ddefault",
        None,
    )
    .await
    .json();
    assert_eq!(names(&all), ["x", "y"], "ns-2/x sorts before ns/y");
}

/// staging/src/k8s.io/apimachinery/pkg/labels/selector.go: set-based requirements
/// (`in`, `notin`, `key`, `!key`, `=`, `==`, `!=`) select as upstream, and a
/// malformed selector is a 400 for a list and for a watch alike.
#[tokio::test]
async fn set_based_label_selectors() {
    let (s, url) = spawn().await;
    for (name, labels) in [
        ("h100", json!({"gpu": "h100", "zone": "a"})),
        ("a100", json!({"gpu": "a100", "zone": "b"})),
        ("cpu", json!({"zone": "a"})),
    ] {
        s.create(
            "nodes",
            "",
            json!({"metadata": {"name": name, "labels": labels}}),
        )
        .unwrap();
    }
    let nodes: Api<Node> = Api::all(client(&url));
    for (sel, want) in [
        ("gpu in (h100,a100)", vec!["a100", "h100"]),
        ("gpu notin (a100)", vec!["cpu", "h100"]),
        ("gpu", vec!["a100", "h100"]),
        ("!gpu", vec!["cpu"]),
        ("zone=a,gpu==h100", vec!["h100"]),
        ("gpu!=h100", vec!["a100", "cpu"]),
        ("zone in (a),!gpu", vec!["cpu"]),
    ] {
        let got: Vec<String> = nodes
            .list(&ListParams::default().labels(sel))
            .await
            .unwrap()
            .items
            .into_iter()
            .map(|n| n.metadata.name.unwrap())
            .collect();
        assert_eq!(got, want, "{sel}");
    }
    for (sel, why) in [
        (
            "gpu in (h100",
            "unable to parse requirement: found '', expected: ',' or ')'",
        ),
        (
            "gpu in",
            "unable to parse requirement: found '' expected: '('",
        ),
        (
            "=h100",
            "found '=', expected: !, identifier, or 'end of string'",
        ),
    ] {
        let q = sel
            .replace(' ', "%20")
            .replace('=', "%3D")
            .replace('(', "%28");
        for watch in ["", "&watch=true"] {
            let a = http(
                &url,
                "GET",
                &format!("/api/v1/nodes?labelSelector={q}{watch}"),
                None,
            )
            .await;
            assert_eq!(a.status, 400, "{sel}{watch}");
            assert_eq!(a.json()["message"], why, "{sel}{watch}");
        }
    }
}

/// pkg/apis/core/v1/conversion.go `AddFieldLabelConversionFunc` and
/// staging/src/k8s.io/apimachinery/pkg/runtime/conversion.go
/// `DefaultMetaV1FieldSelectorConversion`, applied by handlers/get.go: a field a kind
/// does not support is a 400 with the conversion's message; supported ones select on
/// the kind's selectable fields (pkg/registry/core/*/strategy.go).
#[tokio::test]
async fn field_selectors_are_checked_per_kind() {
    let (s, url) = spawn().await;
    s.create(
        "nodes",
        "",
        json!({"metadata": {"name": "n1"}, "spec": {"unschedulable": true}}),
    )
    .unwrap();
    s.create("nodes", "", json!({"metadata": {"name": "n2"}}))
        .unwrap();
    s.create(
        "pods",
        "default",
        json!({"metadata": {"name": "p"}, "spec": {"nodeName": "n1", "containers": []}}),
    )
    .unwrap();
    s.create("events", "default", json!({"metadata": {"name": "e"}, "involvedObject": {"kind": "Node", "name": "n1"}, "reason": "Quarantined"}))
        .unwrap();
    let c = client(&url);
    let nodes: Api<Node> = Api::all(c.clone());
    let cordoned = nodes
        .list(&ListParams::default().fields("spec.unschedulable=true"))
        .await
        .unwrap();
    assert_eq!(cordoned.items.len(), 1);
    let pods: Api<Pod> = Api::namespaced(c.clone(), "default");
    assert_eq!(
        pods.list(&ListParams::default().fields("spec.nodeName=n1,status.phase!=Succeeded"))
            .await
            .unwrap()
            .items
            .len(),
        1
    );
    let events: Api<Event> = Api::namespaced(c.clone(), "default");
    assert_eq!(
        events
            .list(
                &ListParams::default()
                    .fields("involvedObject.kind=Node,involvedObject.name=n1,reason=Quarantined")
            )
            .await
            .unwrap()
            .items
            .len(),
        1
    );
    for (path, sel, why) in [
        ("/api/v1/namespaces/default/pods", "spec.containers=x", "field label not supported: spec.containers"),
        ("/api/v1/nodes", "metadata.namespace=x", "field label not supported: metadata.namespace"),
        ("/api/v1/namespaces/default/configmaps", "data.x=y", "\"data.x\" is not a known field selector: only \"metadata.name\", \"metadata.namespace\""),
        ("/apis/coordination.k8s.io/v1/namespaces/default/leases", "spec.holderIdentity=x", "\"spec.holderIdentity\" is not a known field selector: only \"metadata.name\", \"metadata.namespace\""),
        ("/api/v1/nodes", "metadata.name", "invalid selector: 'metadata.name'; can't understand 'metadata.name'"),
    ] {
        let q = sel.replace('=', "%3D");
        for watch in ["", "&watch=true"] {
            let a = http(&url, "GET", &format!("{path}?fieldSelector={q}{watch}"), None).await;
            assert_eq!(a.status, 400, "{path} {sel}{watch}");
            let status = a.json();
            assert_eq!(status["reason"], "BadRequest");
            assert_eq!(status["message"], why, "{path} {sel}{watch}");
        }
    }
    // A watch with a supported selector streams as before.
    let mut stream = nodes
        .watch(
            &WatchParams::default().fields("metadata.name=n2").timeout(1),
            "0",
        )
        .await
        .unwrap()
        .boxed();
    let first = stream.next().await.unwrap().unwrap();
    assert!(
        matches!(first, kube::api::WatchEvent::Added(n) if n.metadata.name.as_deref() == Some("n2"))
    );
}

/// staging/src/k8s.io/apiserver/pkg/endpoints/handlers/response.go
/// (`asPartialObjectMetadataList`): a client that accepts
/// `as=PartialObjectMetadataList;g=meta.k8s.io;v=v1` gets each object's metadata only,
/// in pages like any list, and is charged those bytes, not the whole Nodes'.
#[tokio::test]
async fn metadata_only_lists_carry_the_metadata_and_cost_its_bytes() {
    let (s, url) = spawn().await;
    for i in 0..3 {
        s.create(
            "nodes",
            "",
            faultline_test_apiserver::fixtures::realistic_node(&format!("gpu-{i}"), "10.0.0.1"),
        )
        .unwrap();
    }
    let nodes: Api<Node> = Api::all(client(&url));
    s.reset_costs();
    let full = nodes.list(&ListParams::default()).await.unwrap();
    let full_bytes = s.costs().total.response_bytes;
    s.reset_costs();
    let meta = nodes
        .list_metadata(&ListParams::default().limit(2))
        .await
        .unwrap();
    let meta_bytes = s.costs().total.response_bytes;
    assert_eq!(full.items.len(), 3);
    assert_eq!(meta.items.len(), 2);
    assert!(meta.metadata.continue_.is_some());
    assert_eq!(meta.items[0].metadata.name.as_deref(), Some("gpu-0"));
    assert!(meta.items[0]
        .metadata
        .labels
        .as_ref()
        .unwrap()
        .contains_key("nvidia.com/gpu.present"));
    assert!(
        meta_bytes * 2 < full_bytes,
        "metadata of 2 nodes: {meta_bytes} bytes; 3 whole nodes: {full_bytes}"
    );
    let one = nodes.get_metadata("gpu-1").await.unwrap();
    assert_eq!(one.metadata.name.as_deref(), Some("gpu-1"));
}

/// pkg/registry/core/pod/strategy.go `NodeNameIndexFunc` and cacher.go `GetList`: a list
/// of one node's pods (`spec.nodeName=N`) is served from the pods' index by node, across
/// namespaces and with the other selectors applied, and follows creates, deletes and
/// graceful deletes (a terminating pod is listed until it is gone); it agrees with the
/// same selection made from the whole list.
#[tokio::test]
async fn one_nodes_pods_come_from_the_index() {
    let (s, url) = spawn().await;
    s.create("namespaces", "", json!({"metadata": {"name": "team"}}))
        .unwrap();
    let pod = |name: &str, node: &str, app: &str| {
        let mut p = json!({"metadata": {"name": name, "labels": {"app": app}},
            "spec": {"containers": [{"name": "c", "image": "x"}]}});
        if !node.is_empty() {
            p["spec"]["nodeName"] = json!(node);
        }
        p
    };
    for (ns, name, node, app) in [
        ("default", "a", "n1", "train"),
        ("default", "b", "n2", "train"),
        ("team", "c", "n1", "web"),
        ("team", "d", "n1", "train"),
        ("default", "e", "", "train"),
    ] {
        s.create("pods", ns, pod(name, node, app)).unwrap();
    }
    let pods: Api<Pod> = Api::all(client(&url));
    let listed = |lp: ListParams| {
        let pods = pods.clone();
        async move {
            pods.list(&lp)
                .await
                .unwrap()
                .items
                .iter()
                .map(|p| {
                    format!(
                        "{}/{}",
                        p.metadata.namespace.clone().unwrap(),
                        p.metadata.name.clone().unwrap()
                    )
                })
                .collect::<Vec<_>>()
        }
    };
    let on = |node: &str| ListParams::default().fields(&format!("spec.nodeName={node}"));
    assert_eq!(listed(on("n1")).await, ["default/a", "team/c", "team/d"]);
    assert_eq!(
        listed(on("n1").labels("app=train")).await,
        ["default/a", "team/d"]
    );
    assert_eq!(listed(on("")).await, ["default/e"], "unscheduled pods");
    assert!(listed(on("n9")).await.is_empty());
    let team: Api<Pod> = Api::namespaced(client(&url), "team");
    let in_team = team.list(&on("n1").match_any()).await.unwrap().items.len();
    assert_eq!(in_team, 2, "one namespace's share of the node");
    // The same answer as the whole list filtered, for every node and the negation.
    let all = listed(ListParams::default()).await;
    for node in ["n1", "n2", ""] {
        let want: Vec<String> = s
            .list("pods", "")
            .into_iter()
            .filter(|p| {
                p.pointer("/spec/nodeName")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    == node
            })
            .map(|p| {
                format!(
                    "{}/{}",
                    p["metadata"]["namespace"].as_str().unwrap(),
                    p["metadata"]["name"].as_str().unwrap()
                )
            })
            .collect();
        assert_eq!(listed(on(node)).await, want, "{node:?} of {all:?}");
    }
    assert_eq!(
        listed(ListParams::default().fields("spec.nodeName!=n1")).await,
        ["default/b", "default/e"]
    );
    // A graceful delete keeps the pod (terminating) on its node; a forced one removes it.
    s.set_faults(faultline_test_apiserver::Faults {
        pod_stop_ms: 60_000,
        ..Default::default()
    });
    pods_delete(&s, "team", "c", Some(30));
    assert_eq!(listed(on("n1")).await, ["default/a", "team/c", "team/d"]);
    pods_delete(&s, "default", "a", None);
    assert_eq!(listed(on("n1")).await, ["team/c", "team/d"]);
    s.create("pods", "default", pod("a", "n2", "train"))
        .unwrap();
    assert_eq!(listed(on("n2")).await, ["default/a", "default/b"]);
    assert_eq!(listed(on("n1")).await, ["team/c", "team/d"]);
}

fn pods_delete(s: &ApiServer, ns: &str, name: &str, grace: Option<i64>) {
    match grace {
        Some(g) => {
            s.delete_with_grace("pods", ns, name, Some(g)).unwrap();
        }
        None => {
            s.delete("pods", ns, name).unwrap();
        }
    }
}
