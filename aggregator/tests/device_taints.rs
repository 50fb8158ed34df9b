//! Issue 28, point 1: the aggregator finds the newest `resource.k8s.io` version that
//! serves DeviceTaintRule, at each release the test API server plays, through the real
//! `kube` client; and finds none where none is served.

use faultline_aggregator::quarantine::discover;
use faultline_test_apiserver::{Bootstrap, Release};

#[tokio::test]
async fn the_taint_api_is_the_newest_the_cluster_serves() {
    let r = |s: &str| Release::parse(s).unwrap();
    let cases = [
        (r("1.34"), None),
        (r("1.35"), None),
        (r("1.35").with_device_taint_rules(true), Some("v1alpha3")),
        (r("1.36"), None),
        (r("1.36").with_device_taint_rules(true), Some("v1beta2")),
        (r("1.37"), Some("v1")),
        (r("1.37").with_device_taint_rules(false), None),
    ];
    for (release, want) in cases {
        let (_server, url) = Bootstrap::new().release(release).spawn().await;
        let client = faultline_aggregator::connect(Some(&url), None, None)
            .await
            .unwrap();
        let got = discover(&client).await.unwrap();
        assert_eq!(
            got.as_ref().map(|t| t.version.as_str()),
            want,
            "{release:?}"
        );
        if let Some(t) = got {
            assert_eq!(t.api_version(), format!("resource.k8s.io/{}", t.version));
        }
    }
}

#[tokio::test]
async fn an_unreachable_api_is_an_error_not_none() {
    // Nothing listens here: "none served" must never be concluded from a failed call.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    let client = faultline_aggregator::connect(Some(&url), None, None)
        .await
        .unwrap();
    assert!(discover(&client).await.is_err());
}
