//! `kubectl faultline ...`: the `faultline` CLI as a kubectl plugin (kubectl runs
//! `kubectl-faultline` from $PATH; see `faultline_aggregator::cli`).

#[tokio::main(flavor = "current_thread")]
async fn main() {
    faultline_aggregator::cli::main("kubectl faultline").await;
}
