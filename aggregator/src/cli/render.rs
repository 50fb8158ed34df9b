//! How the CLI prints what it read: tables like kubectl's (`-o wide` adds columns),
//! or the whole view as JSON or YAML.

use std::fmt::Write as _;

use clap::ValueEnum;
use serde::Serialize;

use super::view::{AgentView, DescribeView, StatusView};

/// `-o`: like kubectl's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// A table with more columns.
    Wide,
    /// The whole view as JSON.
    Json,
    /// The whole view as YAML.
    Yaml,
}

/// JSON or YAML of `v`, or `None` for a table.
pub fn structured<T: Serialize>(v: &T, o: Option<Output>) -> anyhow::Result<Option<String>> {
    Ok(match o {
        Some(Output::Json) => Some(serde_json::to_string_pretty(v)? + "\n"),
        Some(Output::Yaml) => Some(serde_yaml_ng::to_string(v)?),
        _ => None,
    })
}

/// Columns padded to the widest cell, two spaces apart (kubectl's printer).
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut width: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            width[i] = width[i].max(c.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: Vec<&str>| {
        let last = cells.len() - 1;
        for (i, c) in cells.iter().enumerate() {
            if i == last {
                out.push_str(c);
            } else {
                let _ = write!(out, "{c:<w$}  ", w = width[i]);
            }
        }
        out.push('\n');
    };
    line(header.to_vec());
    for r in rows {
        line(r.iter().map(String::as_str).collect());
    }
    out
}

fn or_none(s: Option<&str>) -> String {
    s.filter(|s| !s.is_empty()).unwrap_or("<none>").to_string()
}

/// `status` as a table.
pub fn status(v: &StatusView, wide: bool) -> String {
    let mut out = format!(
        "breaker: {}{}\n",
        v.breaker.state,
        v.breaker
            .reason
            .as_ref()
            .map(|r| format!(" ({r})"))
            .unwrap_or_default()
    );
    let mut header = vec!["NODE", "DEVICES", "SINCE", "BY", "REASON"];
    if wide {
        header.extend(["TAINT", "EVICTED", "BLOCKED", "CANARY", "EXPIRY"]);
    }
    let rows: Vec<Vec<String>> = v
        .quarantined
        .iter()
        .map(|r| {
            let ids: Vec<&str> = r.devices.iter().map(|d| d.id.as_str()).collect();
            let reasons: Vec<&str> = r.devices.iter().map(|d| d.reason.as_str()).collect();
            let mut row = vec![
                r.node.clone(),
                ids.join(","),
                r.first_seen.get(..19).unwrap_or(&r.first_seen).to_string(),
                r.actor.clone(),
                format!(
                    "{}{}",
                    reasons.join(","),
                    if r.unknown_only {
                        " (unknown only)"
                    } else {
                        ""
                    }
                ),
            ];
            if wide {
                row.extend([
                    or_none(r.owned_taint.as_deref()),
                    r.evicted.len().to_string(),
                    r.eviction_blocked.len().to_string(),
                    or_none(
                        r.canary
                            .as_ref()
                            .map(|c| format!("{} {:?}", c.job, c.state))
                            .as_deref(),
                    ),
                    or_none(r.expiry.as_deref()),
                ]);
            }
            row
        })
        .collect();
    out.push_str(&table(&header, &rows));
    out
}

/// `agents` as a table.
pub fn agents(v: &[AgentView], wide: bool) -> String {
    let mut header = vec!["NODE", "REACHABLE", "DEVICES", "FAILED", "SOURCES"];
    if wide {
        header.extend(["SHARD", "LAST-SEEN", "ERROR"]);
    }
    let rows: Vec<Vec<String>> = v
        .iter()
        .map(|a| {
            let sources: Vec<String> = a
                .agent
                .sources
                .iter()
                .map(|s| {
                    if s.up {
                        s.name.clone()
                    } else {
                        format!("{}(down)", s.name)
                    }
                })
                .collect();
            let mut row = vec![
                a.node.clone(),
                a.agent.reachable.to_string(),
                a.summary.total.to_string(),
                a.summary.failed.to_string(),
                or_none(Some(&sources.join(","))),
            ];
            if wide {
                row.extend([
                    a.shard.to_string(),
                    or_none(a.agent.last_seen.as_deref()),
                    or_none(a.agent.error.as_deref()),
                ]);
            }
            row
        })
        .collect();
    table(&header, &rows)
}

/// `describe` in kubectl describe's style.
pub fn describe(v: &DescribeView) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "Node:        {}", v.node);
    match &v.shard {
        Some(s) => {
            let _ = writeln!(
                o,
                "Published:   {} (shard {} of {}, sequence {}, by {} at {})",
                s.configmap, s.shard, s.shards, s.sequence, s.writer, s.timestamp
            );
        }
        None => {
            let _ = writeln!(o, "Published:   <no shard ConfigMap found>");
        }
    }
    let _ = writeln!(o, "Taints:      {}", or_none(Some(&v.taints.join(", "))));
    match &v.published {
        Some(n) => {
            let a = &n.agent;
            let sources: Vec<String> = a
                .sources
                .iter()
                .map(|s| format!("{} ({})", s.name, if s.up { "up" } else { "down" }))
                .collect();
            let _ = writeln!(
                o,
                "Agent:       {}, last seen {}{}",
                if a.reachable {
                    "reachable"
                } else {
                    "unreachable"
                },
                or_none(a.last_seen.as_deref()),
                a.error
                    .as_ref()
                    .map(|e| format!(", error: {e}"))
                    .unwrap_or_default()
            );
            let _ = writeln!(o, "Sources:     {}", or_none(Some(&sources.join(", "))));
            let _ = writeln!(o, "Devices:");
            let rows: Vec<Vec<String>> = n
                .npus
                .iter()
                .map(|d| {
                    vec![
                        d.id.clone(),
                        d.status.as_str().to_string(),
                        d.since.clone(),
                        or_none(d.reason.as_deref()),
                        d.temperature_c
                            .map(|t| format!("{t:.0}C"))
                            .unwrap_or_else(|| "-".into()),
                        d.power_w
                            .map(|p| format!("{p:.0}W"))
                            .unwrap_or_else(|| "-".into()),
                        d.ecc_errors
                            .map(|e| e.to_string())
                            .unwrap_or_else(|| "-".into()),
                        d.pcie_link_status.clone().unwrap_or_else(|| "-".into()),
                        d.recovery_action
                            .map_or_else(|| "-".into(), |a| a.as_str().to_string()),
                        or_none(d.uuid.as_deref()),
                    ]
                })
                .collect();
            let t = table(
                &[
                    "ID", "STATUS", "SINCE", "REASON", "TEMP", "POWER", "ECC", "PCIE", "REPAIR",
                    "UUID",
                ],
                &rows,
            );
            for line in t.lines() {
                let _ = writeln!(o, "  {line}");
            }
        }
        None => {
            let _ = writeln!(
                o,
                "Devices:     <not published: no agent document for this node>"
            );
        }
    }
    match &v.quarantine {
        Some(r) => {
            let _ = writeln!(o, "Quarantine:");
            let _ = writeln!(
                o,
                "  Since:     {} (by {}, from {})",
                r.first_seen, r.actor, r.source
            );
            for d in &r.devices {
                let _ = writeln!(
                    o,
                    "  Device:    {} {}{}{}",
                    d.id,
                    d.reason,
                    d.source
                        .as_ref()
                        .map(|s| format!(" (said by {s})"))
                        .unwrap_or_default(),
                    d.recovery_action
                        .map(|a| format!(", repair: {}", a.as_str()))
                        .unwrap_or_default()
                );
            }
            if r.unknown_only {
                let _ = writeln!(o, "  Unknown only: the devices could not be read");
            }
            isolation(&mut o, r);
            let _ = writeln!(o, "  Evicted:   {}", or_none(Some(&r.evicted.join(", "))));
            for (pod, why) in &r.eviction_blocked {
                let _ = writeln!(o, "  Blocked:   {pod}: {why}");
            }
            for (pod, n) in &r.drains {
                let _ = writeln!(
                    o,
                    "  Draining:  {pod}: evicted at {} at the latest{}",
                    n.evict_after,
                    n.acknowledged
                        .as_ref()
                        .map(|a| format!(", acknowledged {a}"))
                        .unwrap_or_default()
                );
            }
            if let Some(c) = &r.canary {
                let _ = writeln!(
                    o,
                    "  Canary:    {} {:?} since {}",
                    c.job, c.state, c.started
                );
            }
            if let Some(e) = &r.expiry {
                let _ = writeln!(o, "  Expiry:    {e}");
            }
            let _ = writeln!(o, "  Actions:");
            for a in &r.actions {
                let _ = writeln!(o, "    {}  {:<10} {}", a.at, a.action, a.actor);
            }
        }
        None => {
            let _ = writeln!(o, "Quarantine:  <none>");
        }
    }
    if v.history.is_empty() {
        let _ = writeln!(o, "History:     <none>");
    } else {
        let _ = writeln!(o, "History:");
        for r in &v.history {
            let ids: Vec<&str> = r.devices.iter().map(|d| d.id.as_str()).collect();
            let released = r
                .released
                .as_ref()
                .map(|x| format!("released {} by {} ({})", x.at, x.actor, x.reason))
                .unwrap_or_else(|| "not released".into());
            let _ = writeln!(o, "  {}  {}  {}", r.first_seen, ids.join(","), released);
        }
    }
    o
}

/// How a record keeps its devices from new work: the node's taint (and why
/// the node, where a device alone could have been), or each device's DeviceTaintRule,
/// or the device plugin's own isolation.
fn isolation(o: &mut String, r: &crate::remediate::QuarantineRecord) {
    use crate::remediate::DeviceIsolation;
    match &r.isolation {
        Some(DeviceIsolation::DeviceTaintRule { rules }) => {
            let _ = writeln!(
                o,
                "  Isolation: each device alone (DRA DeviceTaintRule); the node is not tainted"
            );
            for d in rules {
                let _ = writeln!(
                    o,
                    "  Rule:      {} {} ({}/{}/{}, effect {}{})",
                    d.id,
                    d.rule,
                    d.driver,
                    d.pool,
                    d.device,
                    d.effect,
                    d.predicted
                        .map(|n| format!(", the controller predicted {n} evicted"))
                        .unwrap_or_default()
                );
            }
        }
        Some(DeviceIsolation::DevicePlugin {
            resource,
            taken_out,
        }) => {
            let _ = writeln!(o, "  Isolation: the device plugin took {taken_out} {resource} out of allocatable; the node is not tainted");
        }
        Some(DeviceIsolation::ManuallySeparateNpu { resource }) => {
            let _ = writeln!(o, "  Isolation: Huawei's device plugin separated the chips for good (ManuallySeparateNPU, {resource}); the node is not tainted");
        }
        None => {}
    }
    if let Some(why) = &r.node_why {
        let _ = writeln!(o, "  Node:      tainted, not the device: {why}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_pad_every_column_but_the_last() {
        let t = table(
            &["NODE", "REASON"],
            &[vec!["gpu-node-1".into(), "xid-79".into()]],
        );
        assert_eq!(t, "NODE        REASON\ngpu-node-1  xid-79\n");
    }

    #[test]
    fn structured_output_is_json_or_yaml() {
        let v = serde_json::json!({"a": [1]});
        assert_eq!(
            structured(&v, Some(Output::Json)).unwrap().unwrap(),
            "{\n  \"a\": [\n    1\n  ]\n}\n"
        );
        assert_eq!(
            structured(&v, Some(Output::Yaml)).unwrap().unwrap(),
            "a:\n- 1\n"
        );
        assert!(structured(&v, Some(Output::Wide)).unwrap().is_none());
        assert!(structured(&v, None).unwrap().is_none());
    }

    #[test]
    fn describe_says_how_the_devices_are_isolated() {
        use crate::remediate::{DeviceIsolation, QuarantineRecord};
        let mut r = QuarantineRecord::new("asc", vec![], "t", "me", "e".into());
        let shown = |r: &QuarantineRecord| {
            let mut o = String::new();
            isolation(&mut o, r);
            o
        };
        assert_eq!(shown(&r), "");
        r.isolation = Some(DeviceIsolation::ManuallySeparateNpu {
            resource: "huawei.com/Ascend910".into(),
        });
        assert_eq!(
            shown(&r),
            "  Isolation: Huawei's device plugin separated the chips for good (ManuallySeparateNPU, huawei.com/Ascend910); the node is not tainted\n"
        );
        r.isolation = Some(DeviceIsolation::DevicePlugin {
            resource: "nvidia.com/gpu".into(),
            taken_out: 1,
        });
        r.node_why = Some("two devices failed".into());
        assert_eq!(
            shown(&r),
            "  Isolation: the device plugin took 1 nvidia.com/gpu out of allocatable; the node is not tainted\n  Node:      tainted, not the device: two devices failed\n"
        );
    }
}
