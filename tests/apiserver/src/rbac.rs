//! Authentication by bearer token and RBAC authorization, as kube-apiserver applies
//! them, so faultline's tests run with exactly the permissions its manifests grant.
//!
//! - The request's attributes (verb, API group, resource, subresource, namespace, name)
//!   follow staging/src/k8s.io/apiserver/pkg/endpoints/request/requestinfo.go: GET of a
//!   collection is `list` (`watch` with `watch=true`), GET of an object `get`, POST
//!   `create`, PUT `update`, PATCH `patch`, DELETE `delete`; a subresource is named
//!   `resource/subresource` in rules.
//! - A rule matches as pkg/apis/rbac/v1/evaluation_helpers.go says (`VerbMatches`,
//!   `APIGroupMatches`, `ResourceMatches`, `ResourceNameMatches`: a rule with
//!   resourceNames never matches a request without a name, such as create or list);
//!   rules come from ClusterRoleBindings (everywhere) and RoleBindings (in their
//!   namespace, to a Role or a ClusterRole), as plugin/pkg/auth/authorizer/rbac/rbac.go
//!   visits them.
//! - A request without credentials is the user `system:anonymous` (kube-apiserver's
//!   default `--anonymous-auth`; kubectl sends no token over plain HTTP), with no
//!   rights unless a binding names it; an unknown token is 401; a request not granted
//!   is 403 Forbidden with upstream's message. The user `admin` (group
//!   `system:masters`) may do anything.

use std::collections::BTreeMap;

use serde_json::Value;

/// The user of the superuser token.
pub const ADMIN: &str = "admin";
/// The user of a request without credentials.
pub const ANONYMOUS: &str = "system:anonymous";

/// What a request asks to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attributes {
    /// get, list, watch, create, update, patch, delete.
    pub verb: String,
    /// The API group (`""` for the core group).
    pub group: String,
    /// The resource, e.g. `pods`.
    pub resource: String,
    /// The subresource, e.g. `eviction`.
    pub subresource: Option<String>,
    /// The namespace (`""` for cluster-scoped requests).
    pub namespace: String,
    /// The object's name, when the request names one.
    pub name: Option<String>,
}

/// Users by bearer token.
#[derive(Debug, Clone, Default)]
pub struct Tokens(pub BTreeMap<String, String>);

impl Tokens {
    /// The user of an `Authorization` header: [`ANONYMOUS`] without one, `None` for a
    /// token nobody has.
    pub fn user(&self, header: Option<&str>) -> Option<&str> {
        let Some(header) = header else {
            return Some(ANONYMOUS);
        };
        let token = header.strip_prefix("Bearer ")?.trim();
        self.0.get(token).map(String::as_str)
    }
}

fn strs(v: &Value, field: &str) -> Vec<String> {
    v.get(field)
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(String::from)
                .collect()
        })
        .unwrap_or_default()
}

/// Whether one PolicyRule allows `a` (evaluation_helpers.go).
pub fn rule_allows(rule: &Value, a: &Attributes) -> bool {
    let verbs = strs(rule, "verbs");
    let groups = strs(rule, "apiGroups");
    let resources = strs(rule, "resources");
    let names = strs(rule, "resourceNames");
    let combined = match &a.subresource {
        Some(s) => format!("{}/{s}", a.resource),
        None => a.resource.clone(),
    };
    let verb_ok = verbs.iter().any(|v| v == "*" || *v == a.verb);
    let group_ok = groups.iter().any(|g| g == "*" || *g == a.group);
    let resource_ok = resources.iter().any(|r| {
        r == "*"
            || *r == combined
            || a.subresource
                .as_ref()
                .is_some_and(|sub| *r == format!("*/{sub}"))
    });
    let name_ok = names.is_empty() || a.name.as_ref().is_some_and(|n| names.contains(n));
    verb_ok && group_ok && resource_ok && name_ok
}

/// Whether a binding names `user` (a ServiceAccount `system:serviceaccount:NS:NAME`, a
/// User, or a Group the user is in).
fn binds(binding: &Value, user: &str) -> bool {
    binding
        .get("subjects")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .any(|s| {
            let kind = s.get("kind").and_then(Value::as_str).unwrap_or("");
            let name = s.get("name").and_then(Value::as_str).unwrap_or("");
            match kind {
                "ServiceAccount" => {
                    let ns = s.get("namespace").and_then(Value::as_str).unwrap_or("");
                    user == format!("system:serviceaccount:{ns}:{name}")
                }
                "User" => user == name,
                "Group" => {
                    name == "system:authenticated"
                        || (name == "system:serviceaccounts"
                            && user.starts_with("system:serviceaccount:"))
                }
                _ => false,
            }
        })
}

/// The RBAC objects a decision is made from.
pub struct Policy<'a> {
    /// ClusterRoles by name.
    pub cluster_roles: BTreeMap<String, &'a Value>,
    /// Roles by (namespace, name).
    pub roles: BTreeMap<(String, String), &'a Value>,
    /// ClusterRoleBindings.
    pub cluster_bindings: Vec<&'a Value>,
    /// RoleBindings with their namespace.
    pub bindings: Vec<(String, &'a Value)>,
}

impl Policy<'_> {
    /// Whether `user` may do `a` (rbac.go: cluster bindings, then the bindings of the
    /// request's namespace).
    pub fn allows(&self, user: &str, a: &Attributes) -> bool {
        if user == ADMIN {
            return true;
        }
        let rules_of = |role: Option<&&Value>| -> Vec<Value> {
            role.and_then(|r| r.get("rules").and_then(Value::as_array))
                .cloned()
                .unwrap_or_default()
        };
        let role_ref = |b: &Value| -> (String, String) {
            let r = b.get("roleRef").cloned().unwrap_or(Value::Null);
            (
                r.get("kind")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string(),
                r.get("name")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string(),
            )
        };
        for b in self.cluster_bindings.iter().filter(|b| binds(b, user)) {
            let (kind, name) = role_ref(b);
            if kind == "ClusterRole"
                && rules_of(self.cluster_roles.get(&name))
                    .iter()
                    .any(|r| rule_allows(r, a))
            {
                return true;
            }
        }
        if a.namespace.is_empty() {
            return false;
        }
        for (ns, b) in self
            .bindings
            .iter()
            .filter(|(ns, b)| *ns == a.namespace && binds(b, user))
        {
            let (kind, name) = role_ref(b);
            let rules = match kind.as_str() {
                "Role" => rules_of(self.roles.get(&(ns.clone(), name))),
                "ClusterRole" => rules_of(self.cluster_roles.get(&name)),
                _ => vec![],
            };
            if rules.iter().any(|r| rule_allows(r, a)) {
                return true;
            }
        }
        false
    }
}

/// Upstream's message for a refused request.
pub fn forbidden_message(user: &str, a: &Attributes) -> String {
    let resource = match &a.subresource {
        Some(s) => format!("{}/{s}", a.resource),
        None => a.resource.clone(),
    };
    let what = match &a.name {
        Some(n) => format!("{} \"{n}\"", a.resource),
        None => a.resource.clone(),
    };
    let scope = if a.namespace.is_empty() {
        "at the cluster scope".to_string()
    } else {
        format!("in the namespace \"{}\"", a.namespace)
    };
    format!(
        "{what} is forbidden: User \"{user}\" cannot {} resource \"{resource}\" in API group \"{}\" {scope}",
        a.verb, a.group
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn attrs(
        verb: &str,
        resource: &str,
        sub: Option<&str>,
        ns: &str,
        name: Option<&str>,
    ) -> Attributes {
        Attributes {
            verb: verb.into(),
            group: String::new(),
            resource: resource.into(),
            subresource: sub.map(String::from),
            namespace: ns.into(),
            name: name.map(String::from),
        }
    }

    #[test]
    fn rules_match_as_upstream_evaluates_them() {
        // pkg/apis/rbac/v1/evaluation_helpers.go
        let evict = json!({"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]});
        assert!(rule_allows(
            &evict,
            &attrs("create", "pods", Some("eviction"), "ns", Some("p"))
        ));
        assert!(
            !rule_allows(&evict, &attrs("create", "pods", None, "ns", None)),
            "a subresource is not its resource"
        );
        assert!(!rule_allows(
            &evict,
            &attrs("delete", "pods", Some("eviction"), "ns", Some("p"))
        ));
        let named = json!({"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "create"], "resourceNames": ["a"]});
        assert!(rule_allows(
            &named,
            &attrs("get", "configmaps", None, "ns", Some("a"))
        ));
        assert!(!rule_allows(
            &named,
            &attrs("get", "configmaps", None, "ns", Some("b"))
        ));
        assert!(
            !rule_allows(&named, &attrs("create", "configmaps", None, "ns", None)),
            "create names nothing"
        );
        let any = json!({"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]});
        assert!(rule_allows(
            &any,
            &attrs("patch", "nodes", Some("status"), "", Some("n"))
        ));
    }

    #[test]
    fn bindings_grant_in_their_scope() {
        let sa = "system:serviceaccount:faultline:agg";
        let role =
            json!({"rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]}]});
        let binding = json!({"subjects": [{"kind": "ServiceAccount", "name": "agg", "namespace": "faultline"}], "roleRef": {"kind": "Role", "name": "r"}});
        let p = Policy {
            cluster_roles: BTreeMap::new(),
            roles: BTreeMap::from([(("faultline".to_string(), "r".to_string()), &role)]),
            cluster_bindings: vec![],
            bindings: vec![("faultline".to_string(), &binding)],
        };
        assert!(p.allows(
            sa,
            &attrs("get", "configmaps", None, "faultline", Some("x"))
        ));
        assert!(
            !p.allows(sa, &attrs("get", "configmaps", None, "default", Some("x"))),
            "another namespace"
        );
        assert!(!p.allows(
            "system:serviceaccount:other:agg",
            &attrs("get", "configmaps", None, "faultline", Some("x"))
        ));
        assert!(p.allows(ADMIN, &attrs("delete", "nodes", None, "", Some("n"))));
        let m = forbidden_message(
            sa,
            &attrs("create", "pods", Some("eviction"), "default", Some("p")),
        );
        assert_eq!(m, "pods \"p\" is forbidden: User \"system:serviceaccount:faultline:agg\" cannot create resource \"pods/eviction\" in API group \"\" in the namespace \"default\"");
    }
}
