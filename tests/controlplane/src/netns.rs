//! Each real-cluster test in a network namespace of its own: the endpointslice
//! controller refuses loopback pod addresses, so the pods' range is made local there,
//! and nothing outside the namespace can be reached.

/// The pod and node addresses of the tests' clusters, local in their network namespace.
pub const POD_RANGE: &str = "10.244.0.0/16";

/// Run test `test` of this test binary in a network namespace of its own, where the
/// nodes' and pods' addresses ([`POD_RANGE`]) are local: the endpointslice controller
/// refuses loopback addresses, and no address outside the namespace is ever reached
/// (it has no interface but `lo`). `true` in the namespace: go on with the test.
/// `false` in the caller, once the test has run there (its output passed through, its
/// failure this one's), or where namespaces cannot be made (skipped, the reason
/// printed; under CI that fails).
pub fn network_namespace(test: &str) -> bool {
    if std::env::var_os("FAULTLINE_NETNS").is_some() {
        return true;
    }
    let can = std::process::Command::new("unshare")
        .args(["--net", "true"])
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !can {
        assert!(
            std::env::var_os("CI").is_none(),
            "{test}: `unshare --net` failed, and CI is set: the real control plane's tests \
             run as root in a network namespace of their own (util-linux, iproute2)"
        );
        eprintln!("SKIPPED {test}: cannot make a network namespace (`unshare --net` needs root)");
        return false;
    }
    let exe = std::env::current_exe().unwrap();
    let setup =
        format!("ip link set lo up && ip route add local {POD_RANGE} dev lo && exec \"$0\" \"$@\"");
    let status = std::process::Command::new("unshare")
        .args(["--net", "--", "sh", "-c", &setup])
        .arg(&exe)
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env("FAULTLINE_NETNS", "1")
        .status()
        .expect("unshare (util-linux)");
    assert!(
        status.success(),
        "{test} failed in its network namespace ({status}; its output is above)"
    );
    false
}
