//! The flags, as a person gives them, through to the checked [`Config`](super::Config).

use std::time::Duration;

use faultline_common::names;

use super::*;
use crate::remediate::Mode;

/// `--name` and `--replica` become object names and a label value; one the
/// API server would refuse fails at start, naming the flag.
#[test]
fn names_are_checked_as_the_api_server_checks_them() {
    for bad in ["Faultline", "fault_line", "-x", &"a".repeat(64)] {
        assert!(
            Config::parse_from(["a", "--name", bad]).is_err(),
            "--name {bad}"
        );
    }
    for bad in ["R1", "r_1", "r1.", ""] {
        let r = Config::parse_from(["a", "--replica", bad]);
        assert!(bad.is_empty() || r.is_err(), "--replica {bad}");
    }
    let long = "r".repeat(240);
    let err = Config::parse_from(["a", "--replica", &long]).unwrap_err();
    assert!(err.to_string().contains("member Lease"), "{err}");
    let c = Config::parse_from([
        "a",
        "--name",
        "gpu-health",
        "--replica",
        "gpu-health-7d9f.x",
    ])
    .unwrap();
    assert_eq!(
        (c.name.as_str(), c.replica.as_str()),
        ("gpu-health", "gpu-health-7d9f.x")
    );
    // A name not given by flag is made one.
    assert_eq!(names::as_subdomain("My_Host.Example."), "my-host.example");
    assert_eq!(names::as_subdomain("--x--"), "x");
    assert_eq!(
        names::as_subdomain("a._b..c"),
        "a.b.c",
        "no part starts with '-'"
    );
}

#[test]
fn agents_must_be_http_urls() {
    let c = Config::parse_from([
        "a",
        "--agents",
        "http://10.0.0.7:8081/, gpu-2=http://n2:8081",
    ])
    .unwrap();
    let urls: Vec<&str> = c.agents.iter().map(|a| a.url.as_str()).collect();
    assert_eq!(urls, vec!["http://10.0.0.7:8081", "http://n2:8081"]);
    assert_eq!(c.agents[0].node, None);
    assert_eq!(c.agents[1].node.as_deref(), Some("gpu-2"));
    assert!(Config::parse_from(["a", "--agents", "Bad_Name=http://n2:8081"]).is_err());
    for bad in ["10.0.0.7:8081", "https://x:1", "http://"] {
        assert!(Config::parse_from(["a", "--agents", bad]).is_err(), "{bad}");
    }
    // An agent that acts is told whom it follows.
    let enforce = |agents: &str| {
        Config::parse_from([
            "a",
            "--sink",
            "configmap",
            "--remediation",
            "enforce",
            "--agents",
            agents,
        ])
    };
    let e = enforce("gpu-2=http://n2:8081,http://10.0.0.7:8081").unwrap_err();
    assert!(e.to_string().contains("NODE=URL"), "{e}");
    assert!(enforce("gpu-2=http://n2:8081").is_ok());
}

#[test]
fn every_flag_reads_faultline_flag_from_the_environment() {
    use clap::CommandFactory;
    let mut n = 0;
    for arg in Args::command().get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        if long == "help" || long == "version" {
            continue;
        }
        let want = format!("FAULTLINE_{}", long.to_uppercase().replace('-', "_"));
        assert_eq!(
            arg.get_env().and_then(|e| e.to_str()),
            Some(want.as_str()),
            "--{long}"
        );
        n += 1;
    }
    assert!(n >= 40, "only {n} flags seen");
}

#[test]
fn durations_and_choices_are_checked_at_start() {
    for (flag, bad) in [
        ("--release-cooldown", "0s"),
        ("--lease-duration", "0"),
        ("--write-interval", "soon"),
        ("--sink", "s3"),
        ("--remediation", "maybe"),
        ("--release", "sometimes"),
        ("--log-format", "xml"),
        ("--runtime-threads", "0"),
    ] {
        let e = Config::parse_from(["a", flag, bad])
            .unwrap_err()
            .to_string();
        assert!(e.contains(bad), "{flag} {bad}: {e}");
    }
    let c = Config::parse_from([
        "a",
        "--sink",
        "configmap",
        "--release",
        "auto",
        "--release-cooldown",
        "90s",
    ])
    .unwrap();
    assert_eq!(
        c.remediation,
        Mode::DryRun,
        "dry-run by default with the ConfigMap sink"
    );
    assert!(c.release.auto);
    assert_eq!(c.release.cooldown, Duration::from_secs(90));
    assert_eq!(Config::parse_from(["a"]).unwrap().remediation, Mode::Off);
    assert!(
        Config::parse_from(["a", "--remediation", "enforce"]).is_err(),
        "acting needs the Leases"
    );
    assert!(Config::parse_from([
        "a",
        "--sink",
        "configmap",
        "--lease-duration",
        "4s",
        "--lease-retry",
        "2s"
    ])
    .is_err());
    // A budget place must outlive a hold: a Lease longer than a quarter of its life is
    // refused, one within it taken.
    let lease = |d: &str| Config::parse_from(["a", "--lease-duration", d]);
    let e = lease("76s").unwrap_err();
    assert!(
        e.to_string()
            .contains("--lease-duration must be at most 75s"),
        "{e}"
    );
    assert!(lease("75s").is_ok());
    // A Node's Events are refused (422) in any other namespace.
    let e = Config::parse_from(["a", "--event-namespace", "faultline"]).unwrap_err();
    assert!(e.to_string().contains("\"default\""), "{e}");
}
