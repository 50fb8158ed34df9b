//! The agents named on the command line (`--agents`, `--agents-file`), checked.

use std::path::Path;

use anyhow::{bail, Context};
use faultline_common::flags::comma_list;
use faultline_common::names;

/// An agent of `--agents`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentTarget {
    /// The node it serves, when given (`NODE=URL`).
    pub node: Option<String>,
    /// Its base URL.
    pub url: String,
}

/// The agents of `listed` (`--agents`) and of the file `file` (`--agents-file`),
/// checked. With `enforce` every agent must name its node (a bare URL's agent
/// names its own, so a hostile one could speak for any node and get it quarantined).
pub fn agents(
    listed: &str,
    file: Option<&Path>,
    enforce: bool,
) -> anyhow::Result<Vec<AgentTarget>> {
    let in_file = match file {
        Some(p) => {
            std::fs::read_to_string(p).with_context(|| format!("--agents-file {}", p.display()))?
        }
        None => String::new(),
    };
    let from_file = in_file
        .lines()
        .map(|l| l.split('#').next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join(",");
    let mut agents = Vec::new();
    for raw in comma_list(listed).chain(comma_list(&from_file)) {
        let (node, url) = match raw.split_once('=') {
            Some((n, u)) if !n.contains(':') => (Some(n.trim().to_string()), u.trim()),
            _ => (None, raw),
        };
        if let Some(n) = &node {
            if let Err(e) = names::dns_subdomain(n) {
                bail!("--agents: not a node name: {e}");
            }
        } else if enforce {
            bail!("--agents {raw}: with --remediation enforce every agent needs its node (NODE=URL): a bare URL's agent would name its own");
        }
        let url = url.trim_end_matches('/').to_string();
        let uri: hyper::Uri = url
            .parse()
            .with_context(|| format!("--agents: {raw:?} is not a URL"))?;
        if uri.scheme_str() != Some("http") || uri.host().is_none() {
            bail!("--agents: {raw:?} must be http://HOST:PORT");
        }
        agents.push(AgentTarget { node, url });
    }
    Ok(agents)
}
