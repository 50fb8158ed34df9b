//! `faultline-watch`: the Rust consumer on the command line, like
//! `consumers/python/faultline_consumer.py` and `consumers/shell/faultline-watch.sh`.
//!
//! ```text
//! faultline-watch --file /config/fault.json [--exit-on-failed]
//! faultline-watch --dir /config --node "$NODE_NAME" [--exit-on-failed] [--device ID]...
//! ```
//! One line per device on each change: `<node> <device> <status> <reason or ->`, after
//! `<node> - unknown verdict-stale` (or `no-verdict`) while the node's verdict is not
//! confirmed; `FAILED <node> <device> <reason>` and exit status 3 with `--exit-on-failed`.

use std::time::Duration;

use faultline_consumer::{Entry, Watch};

fn usage() -> ! {
    eprintln!("usage: faultline-watch (--dir DIR --node NODE | --file FILE) [--device ID]... [--exit-on-failed]");
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
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--dir" => dir = Some(args.next().unwrap_or_else(|| usage())),
            "--file" => file = Some(args.next().unwrap_or_else(|| usage())),
            "--node" => node = Some(args.next().unwrap_or_else(|| usage())),
            "--device" => only.push(args.next().unwrap_or_else(|| usage())),
            "--exit-on-failed" => exit_on_failed = true,
            _ => usage(),
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
                if let Some(e) = entry.filter(|_| exit_on_failed) {
                    let failed = e.failed();
                    if !failed.is_empty() {
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
