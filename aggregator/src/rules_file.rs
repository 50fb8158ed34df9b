//! The rules file (`--rules PATH`, YAML or TOML, JSON also read): loaded at start and
//! reloaded when it changes. An invalid file keeps the rules in force; the error is
//! logged and counted.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use faultline_common::rules::{Rules, RulesError};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;

/// Parse rules text; the format follows the file name (`.toml`, `.yaml`/`.yml`, `.json`).
pub fn parse(path: &Path, text: &str) -> Result<Rules, RulesError> {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    let rules: Rules = match ext {
        "toml" => toml::from_str(text).map_err(|e| RulesError::Parse(e.to_string()))?,
        "json" => serde_json::from_str(text).map_err(|e| RulesError::Parse(e.to_string()))?,
        "yaml" | "yml" | "" => {
            if text.trim().is_empty() {
                Rules::default()
            } else {
                serde_yaml_ng::from_str(text).map_err(|e| RulesError::Parse(e.to_string()))?
            }
        }
        other => {
            return Err(RulesError::Parse(format!(
                "unknown rules format .{other} (use .yaml, .toml or .json)"
            )))
        }
    };
    rules.validate()?;
    Ok(rules)
}

/// Read and parse a rules file.
pub fn load(path: &Path) -> Result<Rules, RulesError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| RulesError::Parse(format!("{}: {e}", path.display())))?;
    parse(path, &text)
}

fn stamp(path: &Path) -> Option<(SystemTime, u64)> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

/// Poll the file every `every` and publish new rules when it changed and is valid.
pub async fn watch_file(
    path: PathBuf,
    tx: watch::Sender<Arc<Rules>>,
    metrics: Arc<Metrics>,
    every: Duration,
    cancel: CancellationToken,
) {
    let mut last = stamp(&path);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        let now = stamp(&path);
        if now == last {
            continue;
        }
        last = now;
        match load(&path) {
            Ok(rules) => {
                tracing::info!(path = %path.display(), "rules reloaded");
                metrics.rules_reload(true);
                tx.send_replace(Arc::new(rules));
            }
            Err(e) => {
                tracing::error!(path = %path.display(), error = %e, "rules reload failed; keeping the rules in force");
                metrics.rules_reload(false);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_and_toml_say_the_same() {
        let yaml = "windows:\n  - reason: hot\n    metric: temperature_c\n    above: 80\n    count: 2\n    of: 4\nstate_machine:\n  failed_recover_samples: 7\n";
        let toml = "[[windows]]\nreason = \"hot\"\nmetric = \"temperature_c\"\nabove = 80.0\ncount = 2\nof = 4\n\n[state_machine]\nfailed_recover_samples = 7\n";
        let a = parse(Path::new("r.yaml"), yaml).unwrap();
        let b = parse(Path::new("r.toml"), toml).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.windows[0].count, 2);
        assert_eq!(a.state_machine.failed_recover_samples, 7);
        // Unset sections keep the seed defaults.
        assert_eq!(a.correlations, Rules::default().correlations);
    }

    #[test]
    fn an_empty_file_is_the_defaults_and_nonsense_is_an_error() {
        assert_eq!(parse(Path::new("r.yaml"), "").unwrap(), Rules::default());
        assert!(parse(Path::new("r.yaml"), "windows: 3").is_err());
        assert!(parse(Path::new("r.yaml"), "surprise: true").is_err());
        assert!(parse(
            Path::new("r.toml"),
            "[[windows]]\nreason='x'\nmetric='temperature_c'\nabove=1.0\ncount=9\nof=2\n"
        )
        .is_err());
        assert!(parse(Path::new("r.ini"), "").is_err());
    }
}
