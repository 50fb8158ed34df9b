//! The apiserver's admission configuration, where a test asks for one.

/// The apiserver's admission configuration: ResourceQuota's `limitedResources` for pods
/// of `classes` (apiserver.config.k8s.io/v1 ResourceQuotaConfiguration).
pub(crate) fn limited_resources(classes: &[String]) -> String {
    format!(
        "apiVersion: apiserver.config.k8s.io/v1
kind: AdmissionConfiguration
plugins:
  - name: ResourceQuota
    configuration:
      apiVersion: apiserver.config.k8s.io/v1
      kind: ResourceQuotaConfiguration
      limitedResources:
        - resource: pods
          matchScopes:
            - scopeName: PriorityClass
              operator: In
              values: {}
",
        serde_json::to_string(classes).unwrap_or_default()
    )
}
