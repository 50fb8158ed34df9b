//! As PID 1 the agent reaps orphaned descendants of its tools, and
//! never takes the exit status of a tool it waits for itself. This test process makes
//! itself a child subreaper (orphans are re-parented to it, as to PID 1) and starts the
//! reaper by force. It runs alone in its own test binary: it changes the process.
#![allow(unsafe_code)]

use std::time::{Duration, Instant};

use faultline_agent::sources::process;

fn zombies_of_mine() -> usize {
    let me = std::process::id().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok())
        .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
        .filter(|stat| {
            let rest: Vec<&str> = stat
                .rsplit_once(')')
                .map(|(_, r)| r.split_whitespace().collect())
                .unwrap_or_default();
            rest.first() == Some(&"Z") && rest.get(1) == Some(&me.as_str())
        })
        .count()
}

#[test]
fn orphans_are_reaped_and_waited_children_are_not_stolen() {
    // SAFETY: prctl with PR_SET_CHILD_SUBREAPER changes only this process's attribute.
    let ok = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } == 0;
    assert!(ok, "prctl(PR_SET_CHILD_SUBREAPER)");
    // Orphans: each tool leaves a short-lived grandchild in another session, which is
    // re-parented here and exits.
    let sh = |s: &str| vec!["sh".to_string(), "-c".to_string(), s.to_string()];
    for _ in 0..5 {
        process::run(
            &sh("setsid sh -c 'sleep 0.2' & echo ok"),
            Duration::from_secs(5),
        )
        .unwrap();
    }
    // Each grandchild exits after 0.2 s and stays a zombie here: wait until all are.
    let t = Instant::now();
    while zombies_of_mine() < 5 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the orphans are zombies here first ({})",
            zombies_of_mine()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(faultline_agent::reaper::start(true));
    let t = Instant::now();
    while zombies_of_mine() > 0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "zombies left: {}",
            zombies_of_mine()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // With the reaper running, tools the agent waits for still report their own exit.
    let handles: Vec<_> = (0..20)
        .map(|i| {
            std::thread::spawn(move || {
                process::run(
                    &["sh".into(), "-c".into(), format!("echo {i}; exit 0")],
                    Duration::from_secs(10),
                )
            })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        assert_eq!(h.join().unwrap().unwrap(), format!("{i}\n"));
    }
    let e = process::run(&sh("exit 3"), Duration::from_secs(5)).unwrap_err();
    assert!(e.to_string().contains("exit status: 3"), "{e}");
}
