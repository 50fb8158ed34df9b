//! `faultline-watch`: the Rust consumer on the command line, like
//! `consumers/python/faultline_consumer.py` and `consumers/shell/faultline-watch.sh`.
//!
//! ```text
//! faultline-watch --file /config/fault.json [--exit-on-failed]
//! faultline-watch --dir /config --node "$NODE_NAME" [--exit-on-failed] [--device ID]...
//! faultline-watch --file /config/fault.json --pod-uid "$POD_UID" --exit-on-drain
//! faultline-watch --ack "http://$HOST_IP:8082" --pod-uid "$POD_UID"
//! ```
//! One line per device on each change: `<node> <device> <status> <reason or ->`, after
//! `<node> - unknown verdict-stale` (or `no-verdict`) while the node's verdict is not
//! confirmed, then one per drain intent: `<node> - drain <namespace>/<pod> <evict_after>
//! <reason>`; `FAILED <node> <device> <reason>` and exit status 3 with
//! `--exit-on-failed`; `DRAIN <namespace>/<pod> evict_after=<time> <reason>` and exit
//! status 4 with `--exit-on-drain` for this pod's (`--pod-uid`, default `$POD_UID`).
//! `--ack` tells the node's agent this pod has checkpointed: exit 0 taken, 1 refused.

use std::time::Duration;

use faultline_consumer::{Entry, Watch};

fn usage() -> ! {
    eprintln!("usage: faultline-watch (--dir DIR --node NODE | --file FILE) [--device ID]... [--exit-on-failed] [--pod-uid UID --exit-on-drain] | --ack AGENT --pod-uid UID");
    std::process::exit(2)
}

fn lines(entry: Option<&Entry>, node: &str) -> Vec<String> {
    match entry {
        None => vec![format!("{node} - unknown not-published")],
        Some(e) if !e.reachable => vec![format!("{} - unknown agent-unreachable", e.node)],
        Some(e) => e
            .stale
            .map(|why| format!("{} - unknown {}", e.node, why.as_str()))
            .into_iter()
            .chain(e.devices.iter().map(|d| {
                format!(
                    "{} {} {} {}",
                    e.node,
                    d.id,
                    d.status.as_str(),
                    d.reason.as_deref().unwrap_or("-")
                )
            }))
            .chain(e.drains.iter().map(|d| {
                format!(
                    "{} - drain {}/{} {} {}",
                    e.node,
                    d.namespace,
                    d.pod,
                    d.evict_after,
                    d.reason.as_deref().unwrap_or("-")
                )
            }))
            .collect(),
    }
}

fn main() {
    let (mut dir, mut file, mut node, mut only, mut exit_on_failed) = (
        None,
        None,
        std::env::var("NODE_NAME").ok(),
        Vec::new(),
        false,
    );
    let (mut pod_uid, mut exit_on_drain, mut ack) =
        (std::env::var("POD_UID").ok(), false, None::<String>);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--pod-uid" => pod_uid = Some(args.next().unwrap_or_else(|| usage())),
            "--exit-on-drain" => exit_on_drain = true,
            "--ack" => ack = Some(args.next().unwrap_or_else(|| usage())),
            "--dir" => dir = Some(args.next().unwrap_or_else(|| usage())),
            "--file" => file = Some(args.next().unwrap_or_else(|| usage())),
            "--node" => node = Some(args.next().unwrap_or_else(|| usage())),
            "--device" => only.push(args.next().unwrap_or_else(|| usage())),
            "--exit-on-failed" => exit_on_failed = true,
            _ => usage(),
        }
    }
    let uid = pod_uid.unwrap_or_default();
    if (exit_on_drain || ack.is_some()) && uid.is_empty() {
        usage()
    }
    if let Some(agent) = ack {
        match faultline_consumer::acknowledge(&agent, &uid, Duration::from_secs(5)) {
            Ok(()) => {
                println!("acknowledged {uid}");
                std::process::exit(0)
            }
            Err(e) => {
                eprintln!("faultline-watch: {e}");
                std::process::exit(1)
            }
        }
    }
    let watch = match (dir, file, &node) {
        (Some(d), None, Some(n)) => Watch::entry(d, n),
        (None, Some(f), _) => Watch::file(f),
        _ => usage(),
    };
    let mut watch = match watch {
        Ok(w) => w.only(only),
        Err(e) => {
            eprintln!("faultline-watch: {e}");
            std::process::exit(1)
        }
    };
    let node = node.unwrap_or_else(|| "-".into());
    loop {
        match watch.next(Duration::from_secs(3600)) {
            Ok(Some(entry)) => {
                for l in lines(entry.as_ref(), &node) {
                    println!("{l}");
                }
                let Some(e) = entry else { continue };
                let failed = e.failed();
                if exit_on_failed && !failed.is_empty() {
                    for d in failed {
                        println!(
                            "FAILED {} {} {}",
                            e.node,
                            d.id,
                            d.reason.as_deref().unwrap_or("-")
                        );
                    }
                    std::process::exit(3);
                }
                if let Some(d) = e.drain_for(&uid).filter(|_| exit_on_drain) {
                    println!(
                        "DRAIN {}/{} evict_after={} {}",
                        d.namespace,
                        d.pod,
                        d.evict_after,
                        d.reason.as_deref().unwrap_or("-")
                    );
                    std::process::exit(4);
                }
            }
            Ok(None) => {}
            Err(e) => {
                eprintln!("faultline-watch: {e}");
                std::process::exit(1)
            }
        }
    }
}
