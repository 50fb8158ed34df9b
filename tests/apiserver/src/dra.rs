//! What kube-apiserver checks and sets on the objects of `resource.k8s.io` (Dynamic
//! Resource Allocation) that faultline reads and writes: ResourceSlices (what a DRA
//! driver publishes per node), ResourceClaims (what a pod was allocated),
//! DeviceClasses, and DeviceTaintRules (what faultline writes to quarantine one device).
//!
//! Validation follows pkg/apis/resource/validation/validation.go and the limits of
//! pkg/apis/resource/types.go; creation and update follow the kinds' strategies
//! (pkg/registry/resource/*/strategy.go). Where unsure, the rule here is the stricter
//! one: a write a cluster might refuse is refused.

use serde_json::Value;

use crate::release::Release;
use crate::validation::{
    is_dns1123_label, is_dns1123_subdomain, is_label_value, is_qualified_name,
};

/// `DriverNameMaxLength` (pkg/apis/resource/types.go).
pub const DRIVER_NAME_MAX: usize = 63;
/// `PoolNameMaxLength`.
pub const POOL_NAME_MAX: usize = 253;
/// `ResourceSliceMaxDevices`.
pub const SLICE_MAX_DEVICES: usize = 128;
/// `ResourceSliceMaxAttributesAndCapacitiesPerDevice`.
pub const DEVICE_MAX_ATTRIBUTES_AND_CAPACITIES: usize = 32;
/// `DeviceAttributeMaxValueLength` (a string or version attribute).
pub const ATTRIBUTE_VALUE_MAX: usize = 64;
/// `AllocationResultsMaxSize`.
pub const ALLOCATION_RESULTS_MAX: usize = 32;
/// `ResourceClaimReservedForMaxSize`.
pub const RESERVED_FOR_MAX: usize = 256;
/// `DeviceTaintRuleStatusMaxConditions` (1.35 on).
pub const TAINT_RULE_MAX_CONDITIONS: usize = 8;

/// `DeviceTaintsMaxLength`: 4 per device in 1.34, 16 from 1.35.
pub fn device_taints_max(r: &Release) -> usize {
    if r.minor >= 35 {
        16
    } else {
        4
    }
}

fn text<'a>(obj: &'a Value, pointer: &str) -> Option<&'a str> {
    obj.pointer(pointer).and_then(Value::as_str)
}

/// `validateDriverName`: required, at most 63 characters, a DNS subdomain.
pub fn driver_name(path: &str, name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err(format!("{path}: Required value"));
    }
    if name.len() > DRIVER_NAME_MAX {
        return Err(format!(
            "{path}: Too long: may not be more than {DRIVER_NAME_MAX} bytes"
        ));
    }
    is_dns1123_subdomain(name).map_err(|e| format!("{path}: Invalid value: {name:?}: {e}"))
}

/// `validatePoolName`: required, at most 253 characters, DNS subdomains joined by `/`.
pub fn pool_name(path: &str, name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err(format!("{path}: Required value"));
    }
    if name.len() > POOL_NAME_MAX {
        return Err(format!(
            "{path}: Too long: may not be more than {POOL_NAME_MAX} bytes"
        ));
    }
    for part in name.split('/') {
        is_dns1123_subdomain(part).map_err(|e| format!("{path}: Invalid value: {name:?}: {e}"))?;
    }
    Ok(())
}

/// `validateDeviceName`: a DNS label.
pub fn device_name(path: &str, name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err(format!("{path}: Required value"));
    }
    is_dns1123_label(name).map_err(|e| format!("{path}: Invalid value: {name:?}: {e}"))
}

/// `validateDeviceTaint`: the key a label name (`metav1validation.ValidateLabelName`,
/// which requires it), the value a label value when set, the effect one of `None`
/// (1.35 on), `NoSchedule`, `NoExecute`; `timeAdded` a timestamp when set.
pub fn device_taint(path: &str, taint: &Value, r: &Release) -> Result<(), String> {
    let key = text(taint, "/key").unwrap_or("");
    let errs = is_qualified_name(key);
    if key.is_empty() {
        return Err(format!("{path}.key: Required value"));
    }
    if let Some(e) = errs.first() {
        return Err(format!("{path}.key: Invalid value: {key:?}: {e}"));
    }
    if let Some(v) = text(taint, "/value").filter(|v| !v.is_empty()) {
        if let Some(e) = is_label_value(v).first() {
            return Err(format!("{path}.value: Invalid value: {v:?}: {e}"));
        }
    }
    let allowed: &[&str] = if r.minor >= 35 {
        &["NoSchedule", "NoExecute", "None"]
    } else {
        &["NoSchedule", "NoExecute"]
    };
    match text(taint, "/effect") {
        None | Some("") => return Err(format!("{path}.effect: Required value")),
        Some(e) if !allowed.contains(&e) => {
            return Err(format!(
                "{path}.effect: Unsupported value: {e:?}: supported values: {allowed:?}"
            ))
        }
        _ => {}
    }
    if let Some(t) = taint.get("timeAdded").filter(|t| !t.is_null()) {
        if !t.as_str().is_some_and(is_rfc3339) {
            return Err(format!(
                "{path}.timeAdded: Invalid value: {t}: not an RFC 3339 time"
            ));
        }
    }
    Ok(())
}

/// `metav1.Time` as JSON carries it: `2026-12-05T03:00:00Z` (seconds, UTC or an offset).
fn is_rfc3339(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() >= 20
        && b[4] == b'-'
        && b[7] == b'-'
        && b[10] == b'T'
        && b[13] == b':'
        && b[16] == b':'
        && [0, 1, 2, 3, 5, 6, 8, 9, 11, 12, 14, 15, 17, 18]
            .iter()
            .all(|&i| b[i].is_ascii_digit())
        && (s.ends_with('Z') || s[19..].contains(['+', '-']))
}

/// `ValidateDeviceTaintRule`: the selector's driver, pool and device names when set
/// (a rule with none of them matches every device; a missing selector matches none),
/// the taint, and at most 8 status conditions, each with a type and a status.
pub fn device_taint_rule(obj: &Value, r: &Release) -> Result<(), String> {
    let spec = obj.get("spec").ok_or("spec: Required value")?;
    if let Some(sel) = spec.get("deviceSelector").filter(|s| !s.is_null()) {
        for gone in ["deviceClassName", "selectors"] {
            if sel.get(gone).is_some() && r.minor >= 35 {
                // Tombstoned in 1.35: the field is unknown, and strict decoding refuses it.
                return Err(format!("spec.deviceSelector.{gone}: unknown field"));
            }
        }
        if let Some(d) = text(sel, "/driver") {
            driver_name("spec.deviceSelector.driver", d)?;
        }
        if let Some(p) = text(sel, "/pool") {
            pool_name("spec.deviceSelector.pool", p)?;
        }
        if let Some(d) = text(sel, "/device") {
            device_name("spec.deviceSelector.device", d)?;
        }
    }
    let taint = spec.get("taint").ok_or("spec.taint: Required value")?;
    device_taint("spec.taint", taint, r)?;
    let conditions = obj
        .pointer("/status/conditions")
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice);
    if conditions.len() > TAINT_RULE_MAX_CONDITIONS {
        return Err(format!(
            "status.conditions: Too many: {}: must have at most {TAINT_RULE_MAX_CONDITIONS} items",
            conditions.len()
        ));
    }
    for (i, c) in conditions.iter().enumerate() {
        if text(c, "/type").is_none_or(str::is_empty) {
            return Err(format!("status.conditions[{i}].type: Required value"));
        }
        if !matches!(text(c, "/status"), Some("True" | "False" | "Unknown")) {
            return Err(format!("status.conditions[{i}].status: Unsupported value"));
        }
    }
    Ok(())
}

/// `ValidateResourceSlice`: driver and pool (generation ≥ 0, resourceSliceCount ≥ 1),
/// exactly one of the node fields, at most 128 devices with valid, distinct names, at
/// most 32 attributes and capacities per device, each attribute exactly one value, and
/// the device taints (at most `DeviceTaintsMaxLength`).
pub fn resource_slice(obj: &Value, r: &Release) -> Result<(), String> {
    let spec = obj.get("spec").ok_or("spec: Required value")?;
    driver_name("spec.driver", text(spec, "/driver").unwrap_or(""))?;
    pool_name("spec.pool.name", text(spec, "/pool/name").unwrap_or(""))?;
    if spec
        .pointer("/pool/generation")
        .and_then(Value::as_i64)
        .is_none_or(|g| g < 0)
    {
        return Err(
            "spec.pool.generation: Invalid value: must be greater than or equal to 0".into(),
        );
    }
    if spec
        .pointer("/pool/resourceSliceCount")
        .and_then(Value::as_i64)
        .is_none_or(|c| c < 1)
    {
        return Err("spec.pool.resourceSliceCount: Invalid value: must be greater than 0".into());
    }
    let node_fields = [
        "nodeName",
        "nodeSelector",
        "allNodes",
        "perDeviceNodeSelection",
    ]
    .iter()
    .filter(|f| {
        spec.get(**f).is_some_and(|v| {
            !v.is_null() && *v != Value::Bool(false) && *v != Value::String(String::new())
        })
    })
    .count();
    if node_fields != 1 {
        return Err("spec: Invalid value: exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required".into());
    }
    if let Some(n) = text(spec, "/nodeName") {
        is_dns1123_subdomain(n).map_err(|e| format!("spec.nodeName: Invalid value: {e}"))?;
    }
    let devices = spec
        .get("devices")
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice);
    if devices.len() > SLICE_MAX_DEVICES {
        return Err(format!(
            "spec.devices: Too many: {}: must have at most {SLICE_MAX_DEVICES} items",
            devices.len()
        ));
    }
    let mut names = std::collections::BTreeSet::new();
    for (i, d) in devices.iter().enumerate() {
        let at = format!("spec.devices[{i}]");
        let name = text(d, "/name").unwrap_or("");
        device_name(&format!("{at}.name"), name)?;
        if !names.insert(name) {
            return Err(format!("{at}.name: Duplicate value: {name:?}"));
        }
        let attrs = d.get("attributes").and_then(Value::as_object);
        let caps = d.get("capacity").and_then(Value::as_object);
        let n = attrs.map_or(0, |a| a.len()) + caps.map_or(0, |c| c.len());
        if n > DEVICE_MAX_ATTRIBUTES_AND_CAPACITIES {
            return Err(format!("{at}: Too many: {n} attributes and capacities: must have at most {DEVICE_MAX_ATTRIBUTES_AND_CAPACITIES}"));
        }
        for (key, v) in attrs.into_iter().flatten() {
            attribute(&format!("{at}.attributes[{key:?}]"), v)?;
        }
        let taints = d
            .get("taints")
            .and_then(Value::as_array)
            .map_or(&[][..], Vec::as_slice);
        if taints.len() > device_taints_max(r) {
            return Err(format!(
                "{at}.taints: Too many: {}: must have at most {} items",
                taints.len(),
                device_taints_max(r)
            ));
        }
        for (j, t) in taints.iter().enumerate() {
            device_taint(&format!("{at}.taints[{j}]"), t, r)?;
        }
    }
    Ok(())
}

/// `validateDeviceAttribute`: exactly one of int, bool, string, version; a string or
/// version at most 64 characters.
fn attribute(path: &str, v: &Value) -> Result<(), String> {
    let set: Vec<&str> = ["int", "bool", "string", "version"]
        .into_iter()
        .filter(|f| v.get(*f).is_some_and(|x| !x.is_null()))
        .collect();
    if set.len() != 1 {
        return Err(format!(
            "{path}: Invalid value: exactly one value must be specified"
        ));
    }
    for f in ["string", "version"] {
        if let Some(s) = v.get(f).and_then(Value::as_str) {
            if s.len() > ATTRIBUTE_VALUE_MAX {
                return Err(format!(
                    "{path}.{f}: Too long: may not be more than {ATTRIBUTE_VALUE_MAX} bytes"
                ));
            }
        }
    }
    Ok(())
}

/// `ValidateResourceClaim` and its status: at most 32 allocation results, each naming a
/// request, a driver, a pool and a device validly; at most 256 consumers reserved,
/// each with a resource, a name and a uid, none twice.
pub fn resource_claim(obj: &Value) -> Result<(), String> {
    // The spec's requests (pkg/apis/resource/validation/validation.go
    // validateDeviceRequest, validateSelector, validateDeviceToleration): a name
    // each, once; an exact request names its DeviceClass; a CEL selector has an
    // expression; a toleration's operator is Exists or Equal. (Stricter upstream, not
    // modelled: the name's DNS-label form, CEL compilation.)
    let requests = obj
        .pointer("/spec/devices/requests")
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice);
    let mut names = std::collections::BTreeSet::new();
    for (i, q) in requests.iter().enumerate() {
        let at = format!("spec.devices.requests[{i}]");
        let name = text(q, "/name").unwrap_or("");
        if name.is_empty() || !names.insert(name) {
            return Err(format!("{at}.name: Required value or Duplicate value"));
        }
        let Some(exactly) = q.get("exactly") else {
            continue;
        };
        if text(exactly, "/deviceClassName").is_none_or(str::is_empty) {
            return Err(format!("{at}.exactly.deviceClassName: Required value"));
        }
        for (j, s) in exactly
            .get("selectors")
            .and_then(Value::as_array)
            .map_or(&[][..], Vec::as_slice)
            .iter()
            .enumerate()
        {
            if text(s, "/cel/expression").is_none_or(str::is_empty) {
                return Err(format!(
                    "{at}.exactly.selectors[{j}].cel.expression: Required value"
                ));
            }
        }
        for (j, t) in exactly
            .get("tolerations")
            .and_then(Value::as_array)
            .map_or(&[][..], Vec::as_slice)
            .iter()
            .enumerate()
        {
            if !matches!(text(t, "/operator").unwrap_or("Equal"), "Exists" | "Equal") {
                return Err(format!(
                    "{at}.exactly.tolerations[{j}].operator: Unsupported value"
                ));
            }
        }
    }
    let results = obj
        .pointer("/status/allocation/devices/results")
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice);
    if results.len() > ALLOCATION_RESULTS_MAX {
        return Err(format!("status.allocation.devices.results: Too many: {}: must have at most {ALLOCATION_RESULTS_MAX} items", results.len()));
    }
    for (i, res) in results.iter().enumerate() {
        let at = format!("status.allocation.devices.results[{i}]");
        if text(res, "/request").is_none_or(str::is_empty) {
            return Err(format!("{at}.request: Required value"));
        }
        driver_name(&format!("{at}.driver"), text(res, "/driver").unwrap_or(""))?;
        pool_name(&format!("{at}.pool"), text(res, "/pool").unwrap_or(""))?;
        device_name(&format!("{at}.device"), text(res, "/device").unwrap_or(""))?;
    }
    let reserved = obj
        .pointer("/status/reservedFor")
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice);
    if reserved.len() > RESERVED_FOR_MAX {
        return Err(format!(
            "status.reservedFor: Too many: {}: must have at most {RESERVED_FOR_MAX} items",
            reserved.len()
        ));
    }
    let mut uids = std::collections::BTreeSet::new();
    for (i, c) in reserved.iter().enumerate() {
        for f in ["resource", "name", "uid"] {
            if text(c, &format!("/{f}")).is_none_or(str::is_empty) {
                return Err(format!("status.reservedFor[{i}].{f}: Required value"));
            }
        }
        if !uids.insert(text(c, "/uid").unwrap_or("")) {
            return Err(format!("status.reservedFor[{i}].uid: Duplicate value"));
        }
    }
    Ok(())
}

/// What the strategies set on create (`PrepareForCreate`): generation 1, and a
/// DeviceTaintRule's `spec.taint.timeAdded` when the client left it out
/// (pkg/registry/resource/devicetaintrule/strategy.go); a rule starts with no status.
pub fn prepare_for_create(plural: &str, obj: &mut Value, now: &str) {
    obj["metadata"]["generation"] = serde_json::json!(1);
    if plural == "devicetaintrules" {
        if let Some(o) = obj.as_object_mut() {
            o.remove("status");
        }
        if let Some(t) = obj
            .pointer_mut("/spec/taint")
            .and_then(Value::as_object_mut)
        {
            if t.get("timeAdded").is_none_or(Value::is_null) {
                t.insert("timeAdded".into(), serde_json::json!(now));
            }
        }
    }
}

/// What the strategies set on update (`PrepareForUpdate`): a new spec is a new
/// generation; a DeviceTaintRule whose effect changed while its `timeAdded` did not
/// gets the time of the change, in whole seconds ("TimeAdded track[s] when was this
/// *effect* added", pkg/registry/resource/devicetaintrule/strategy.go).
pub fn prepare_for_update(plural: &str, old: &Value, obj: &mut Value, now: &str) {
    if obj.get("spec") != old.get("spec") {
        let generation = old
            .pointer("/metadata/generation")
            .and_then(Value::as_i64)
            .unwrap_or(1);
        obj["metadata"]["generation"] = serde_json::json!(generation + 1);
    }
    if plural == "devicetaintrules" {
        let (was, is) = (old.pointer("/spec/taint"), obj.pointer("/spec/taint"));
        let moved = |f: &str| was.and_then(|t| t.get(f)) != is.and_then(|t| t.get(f));
        if moved("effect") && !moved("timeAdded") {
            if let Some(t) = obj
                .pointer_mut("/spec/taint")
                .and_then(Value::as_object_mut)
            {
                t.insert("timeAdded".into(), serde_json::json!(now));
            }
        }
    }
}
