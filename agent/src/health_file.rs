//! `--health-file`: write the node's health document atomically (temp file + rename)
//! on every change, for tools on the host that read it without the API.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::store::Store;

/// Write `bytes` to `path` so readers see the old file or the new one, never half.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("node.json");
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// Rewrite the file whenever the generation moves.
pub async fn run(
    path: PathBuf,
    store: Arc<Store>,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
) {
    let mut rx = store.subscribe();
    loop {
        let doc = store.render();
        match serde_json::to_vec_pretty(&doc) {
            Ok(bytes) => {
                let p = path.clone();
                let r = tokio::task::spawn_blocking(move || write_atomic(&p, &bytes)).await;
                if let Ok(Err(e)) | Err(e) = r.map_err(std::io::Error::other) {
                    metrics.count_error("node-file", "write");
                    tracing::warn!(path = %path.display(), error = %e, "cannot write the node file");
                }
            }
            Err(e) => tracing::error!(error = %e, "cannot encode the node document"),
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            r = rx.changed() => if r.is_err() { return },
        }
    }
}
