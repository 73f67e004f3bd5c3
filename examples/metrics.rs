//! The locks' metrics in Prometheus text on an admin port: a recorder with histogram
//! buckets, installed once, and a `GET /metrics` that renders it.
//!
//! ```sh
//! cargo run --example metrics
//! curl -X PUT localhost:3000/orders/42 && curl localhost:3001/metrics
//! ```

use axum::{
    routing::{get, put},
    Router,
};
use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder, PrometheusRecorder};
use tower_batch_lock::{keys, Locks};

/// A Prometheus recorder whose `_seconds` histograms have buckets (without them the
/// exporter prints summaries, which cannot be added up across processes).
pub fn recorder() -> Result<PrometheusRecorder, BuildError> {
    Ok(PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Suffix("_seconds".to_owned()),
            &[0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5],
        )?
        .set_buckets_for_metric(
            Matcher::Full("tower_batch_lock_keys".to_owned()),
            &[1.0, 10.0, 100.0, 1_000.0, 3_000.0, 10_000.0],
        )?
        .build_recorder())
}

/// The service's routes, with their metrics labelled `orders`.
pub fn app(locks: &Locks) -> Router {
    let locks = locks.clone().metrics_label("orders");
    Router::new().route(
        "/orders/{id}",
        put(|| async { "updated" }).layer(locks.layer(keys::path("order"))),
    )
}

/// The admin port's routes: `GET /metrics` renders what `recorder` recorded.
pub fn admin(recorder: &PrometheusRecorder) -> Router {
    let handle = recorder.handle();
    Router::new().route("/metrics", get(move || async move { handle.render() }))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let recorder = recorder()?;
    let admin = admin(&recorder);
    metrics::set_global_recorder(recorder)?;
    let service = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    let admin_port = tokio::net::TcpListener::bind("127.0.0.1:3001").await?;
    tokio::spawn(async move { axum::serve(admin_port, admin).await });
    axum::serve(service, app(&Locks::memory())).await?;
    Ok(())
}
