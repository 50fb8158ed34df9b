//! The pinned helm, built from its Go module like the control plane.

use std::path::PathBuf;

use faultline_common::testing::repo_root;

/// The pinned helm (`tests/helm/build.sh`, built from its Go module when the cache
/// lacks it): its path. `None`, with the reason printed, where Go is missing and `CI` is
/// unset; under `CI` a missing Go fails.
pub fn helm(test: &str) -> Option<PathBuf> {
    let script = repo_root().join("tests/helm/build.sh");
    if std::process::Command::new("go")
        .arg("version")
        .stdout(std::process::Stdio::null())
        .status()
        .is_err()
    {
        assert!(
            std::env::var_os("CI").is_none(),
            "{test}: no `go` on PATH, and CI is set: helm is built from its Go module; \
             install Go 1.26 or newer (the go command on PATH)"
        );
        eprintln!("SKIPPED {test}: no `go` on PATH: helm is built from its Go module");
        return None;
    }
    let out = std::process::Command::new("bash")
        .arg(&script)
        .stderr(std::process::Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", script.display()));
    assert!(
        out.status.success(),
        "{test}: {} failed ({})",
        script.display(),
        out.status
    );
    Some(PathBuf::from(String::from_utf8(out.stdout).unwrap().trim()))
}
