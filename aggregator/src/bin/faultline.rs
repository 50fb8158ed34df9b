//! `faultline`: what an SRE runs against the cluster (see `faultline_aggregator::cli`).
//! Installed (copied or linked) as `kubectl-faultline` it is the kubectl plugin, `kubectl
//! faultline ...` (kubectl runs `kubectl-faultline` from $PATH): one binary, so a release
//! build links and optimizes the CLI once, not twice.

use std::path::Path;

/// How the CLI names itself in its help and errors, from the name it was run by.
fn invoked_as(argv0: Option<std::ffi::OsString>) -> &'static str {
    let name = argv0
        .as_deref()
        .map(Path::new)
        .and_then(Path::file_name)
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    if name.starts_with("kubectl-faultline") {
        "kubectl faultline"
    } else {
        "faultline"
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    faultline_aggregator::cli::main(invoked_as(std::env::args_os().next())).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plugin_is_the_cli_under_another_name() {
        let as_ = |s: &str| invoked_as(Some(s.into()));
        assert_eq!(as_("/usr/local/bin/kubectl-faultline"), "kubectl faultline");
        assert_eq!(as_("kubectl-faultline.exe"), "kubectl faultline");
        assert_eq!(as_("/usr/local/bin/faultline"), "faultline");
        assert_eq!(invoked_as(None), "faultline");
    }
}
