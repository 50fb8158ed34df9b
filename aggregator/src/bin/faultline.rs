//! `faultline`: what an SRE runs against the cluster (see `faultline_aggregator::cli`).

#[tokio::main(flavor = "current_thread")]
async fn main() {
    faultline_aggregator::cli::main("faultline").await;
}
