//! Process wiring shared by the `faultline-agent` and `faultline-aggregator` binaries
//! (cargo feature `runtime`): logging to stderr as text or JSON, and waiting for the
//! signal that stops the process.

/// Install the global `tracing` subscriber: filter from `RUST_LOG` (default `info`),
/// written to stderr, one JSON object a line when `json`, plain text otherwise.
///
/// Panics if a global subscriber is already installed (call it once, from `main`).
pub fn init_tracing(json: bool) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        fmt.json().init();
    } else {
        fmt.init();
    }
}

/// Return once SIGTERM or ctrl-c (SIGINT) arrives, after logging "shutting down".
///
/// If the SIGTERM handler cannot be installed, only ctrl-c is waited for; if neither
/// can, this returns at once rather than leave the process unstoppable.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).ok();
        let sigterm = async {
            match term.as_mut() {
                Some(t) => {
                    t.recv().await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {},
            _ = sigterm => {},
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
    tracing::info!("shutting down");
}
