//! Handing alerts to their shard's holder: who may receive them (a running Pod of this
//! namespace at the address its Lease advertises), and why a hand-over failed.

/// Why alerts could not be handed to their shard's holder (the sender is told 503 and
/// to retry).
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// The shard's Lease could not be read.
    #[error("cannot read Lease {lease}: {source}")]
    Lease {
        /// Its name.
        lease: String,
        /// Why.
        source: kube::Error,
    },
    /// Nobody (else) holds the shard.
    #[error("shard {0} has no live holder")]
    NoHolder(u32),
    /// The holder advertises no URL, or one without a host.
    #[error("the holder {holder} advertises no usable URL ({url:?})")]
    NoUrl {
        /// The holder.
        holder: String,
        /// What it advertises.
        url: Option<String>,
    },
    /// The holder's Pod could not be read.
    #[error("cannot read the Pod of {holder}: {source}")]
    Pod {
        /// The holder.
        holder: String,
        /// Why.
        source: kube::Error,
    },
    /// The holder is not a Pod of this namespace.
    #[error("the holder {0} is not a Pod of this namespace; nothing is forwarded")]
    NoPod(String),
    /// The holder's Pod is not running at the address it advertises.
    #[error("the holder {holder} advertises {url}, which is not its running Pod's IP ({ips}); nothing is forwarded")]
    NotThePeer {
        /// The holder.
        holder: String,
        /// What it advertises.
        url: String,
        /// Its Pod's addresses, if any.
        ips: String,
    },
    /// The holder did not answer, or not as asked.
    #[error("{holder} at {url}: {why}")]
    Answer {
        /// The holder.
        holder: String,
        /// Where.
        url: String,
        /// What went wrong.
        why: String,
    },
}

impl ForwardError {
    /// The metric label of this failure.
    pub fn metric_label(&self) -> &'static str {
        match self {
            ForwardError::Lease { .. } | ForwardError::Pod { .. } => "api",
            ForwardError::NoHolder(_) => "no-holder",
            ForwardError::NoUrl { .. }
            | ForwardError::NoPod(_)
            | ForwardError::NotThePeer { .. } => "not-the-peer",
            ForwardError::Answer { .. } => "answer",
        }
    }
}

/// The alerts (and the bearer token) go only to a replica: the Lease's holder must be a
/// running Pod of this namespace whose IP is the host of the URL it advertises. A Lease
/// edited to point elsewhere gets nothing.
pub(super) async fn verify_peer(
    pods: &kube::Api<k8s_openapi::api::core::v1::Pod>,
    holder: &str,
    url: &str,
) -> Result<(), ForwardError> {
    let host = url
        .parse::<hyper::Uri>()
        .ok()
        .and_then(|u| u.host().map(|h| h.trim_matches(['[', ']']).to_string()))
        .ok_or_else(|| ForwardError::NoUrl {
            holder: holder.into(),
            url: Some(url.into()),
        })?;
    let not_the_peer = |ips: &[String]| ForwardError::NotThePeer {
        holder: holder.into(),
        url: url.into(),
        ips: ips.join(", "),
    };
    let pod = pods
        .get_opt(holder)
        .await
        .map_err(|source| ForwardError::Pod {
            holder: holder.into(),
            source,
        })?
        .ok_or_else(|| ForwardError::NoPod(holder.into()))?;
    let status = pod.status.unwrap_or_default();
    let running =
        status.phase.as_deref() == Some("Running") && pod.metadata.deletion_timestamp.is_none();
    let ips: Vec<String> = status
        .pod_ips
        .unwrap_or_default()
        .into_iter()
        .map(|p| p.ip)
        .chain(status.pod_ip)
        .collect();
    if !running || !ips.contains(&host) {
        return Err(not_the_peer(&ips));
    }
    Ok(())
}
