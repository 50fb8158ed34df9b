//! `faultline-aggregator`: wiring only; see the library.

use clap::Parser;
use faultline_aggregator::config::{Args, Config};
use faultline_common::runtime::{init_tracing, shutdown_signal};

/// mimalloc, not glibc's malloc: a replica parses and drops a document per agent change
/// all the time, and glibc spent about a third of the process's CPU in malloc, free and
/// consolidation (`perf` at 5,000 nodes); see the README's scale-out figures.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    let cfg = Config::from_args(Args::parse())?;
    init_tracing(cfg.log_json);
    // `--runtime-threads`: one thread runs every task (the default), or a pool.
    let runtime = match cfg.runtime_threads {
        1 => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?,
        n => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(usize::from(n))
            .enable_all()
            .build()?,
    };
    runtime.block_on(async move {
        let agg = faultline_aggregator::start(cfg).await?;
        let cancel = agg.cancel_token();
        tokio::spawn(async move {
            shutdown_signal().await;
            cancel.cancel();
        });
        // A task that panicked or ended unasked: exit non-zero, so the replica is
        // restarted (its Leases were released where the Lease loop still ran).
        agg.wait().await?;
        Ok(())
    })
}
