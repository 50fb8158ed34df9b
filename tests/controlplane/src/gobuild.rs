//! The tools the tests build from their Go modules, each by its build script in this
//! repository, cached by version: the control plane ([`crate::binaries`]) and helm.

use std::path::PathBuf;

use faultline_common::testing::repo_root;

/// What build script `script` (from the repository root) prints with `args`: the path
/// of what it built, or found in its cache. `None`, with the reason printed, where Go
/// is missing and `CI` is unset; under `CI` a missing Go fails. `what` names the tool.
pub(crate) fn go_built(test: &str, script: &str, args: &[&str], what: &str) -> Option<PathBuf> {
    let script = repo_root().join(script);
    if std::process::Command::new("go")
        .arg("version")
        .stdout(std::process::Stdio::null())
        .status()
        .is_err()
    {
        assert!(
            std::env::var_os("CI").is_none(),
            "{test}: no `go` on PATH, and CI is set: {what} is built from its Go modules; \
             install Go 1.26 or newer (the go command on PATH)"
        );
        eprintln!(
            "SKIPPED {test}: no `go` on PATH: {what} is built from its Go modules; install \
             Go 1.26 to run it"
        );
        return None;
    }
    let out = std::process::Command::new("bash")
        .arg(&script)
        .args(args)
        .stderr(std::process::Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", script.display()));
    assert!(
        out.status.success(),
        "{test}: {} {} failed ({})",
        script.display(),
        args.join(" "),
        out.status
    );
    Some(PathBuf::from(String::from_utf8(out.stdout).unwrap().trim()))
}

/// The pinned helm (`tests/helm/build.sh`, built when the cache lacks it): its path.
/// `None` as [`go_built`] says.
pub fn helm(test: &str) -> Option<PathBuf> {
    go_built(test, "tests/helm/build.sh", &[], "helm")
}
