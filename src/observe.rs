//! What the layer records through the [`metrics`] facade (feature `metrics`, on by
//! default): the application installs a recorder (a Prometheus exporter, say), and without
//! one, recording costs next to nothing. Names and units follow Prometheus's conventions.
//! Label values are a layer's name or route, fixed words and Redlock masters' addresses:
//! never keys, which are unbounded and may be secrets.

use std::{sync::Arc, time::Duration};

use crate::store::contract::Modes;

/// The labels of a request's metrics: `layer`, the name given to its layer
/// ([`Locks::metrics_label`](crate::Locks::metrics_label)), else the route it matched, else
/// `unnamed`; and `mode`, how its batch is held (`exclusive`, `shared` or `mixed`), on the
/// series where readers and writers differ: acquisitions, their time and the waiting.
#[derive(Debug, Clone)]
pub(crate) struct Layer {
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    name: Option<Arc<str>>,
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    mode: &'static str,
}

impl Layer {
    /// The label of what no name or route names (a handler's `Lease::lock`, a service
    /// outside an axum router).
    pub(crate) const UNNAMED: Self = Self {
        name: None,
        mode: "exclusive",
    };

    /// The labels of a layer's requests; `shared` when the layer holds every key shared,
    /// before the batch is known (a refused request counts under it).
    pub(crate) fn new(name: Option<&Arc<str>>, route: Option<&str>, shared: bool) -> Self {
        Self {
            name: name.cloned().or_else(|| route.map(Arc::from)),
            mode: if shared { "shared" } else { "exclusive" },
        }
    }

    /// The same labels, for a batch held in `modes`.
    pub(crate) fn holding(mut self, modes: &Modes) -> Self {
        self.mode = match modes {
            Modes::All(mode) => mode.as_str(),
            Modes::Each(_) => "mixed",
        };
        self
    }
}

/// How a request that reached the layer with keys (or with input it refused) ended.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Outcome {
    Granted,
    /// Answered with the contention status.
    Contended,
    /// Answered 503: the store did not answer in time.
    Unavailable,
    /// Bad input: the extractor refused it, or its keys broke a limit.
    Rejected,
}

impl Outcome {
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    fn as_str(self) -> &'static str {
        match self {
            Self::Granted => "granted",
            Self::Contended => "contended",
            Self::Unavailable => "unavailable",
            Self::Rejected => "rejected",
        }
    }
}

#[cfg(feature = "metrics")]
mod record {
    use metrics::{counter, gauge, histogram, SharedString};

    use super::*;

    fn label(layer: &Layer) -> SharedString {
        layer
            .name
            .clone()
            .map_or(SharedString::const_str("unnamed"), SharedString::from)
    }

    pub(crate) fn outcome(layer: &Layer, outcome: Outcome, acquiring: Option<Duration>) {
        let (mode, outcome) = (layer.mode, outcome.as_str());
        let layer = label(layer);
        counter!(
            "tower_batch_lock_acquisitions_total",
            "layer" => layer.clone(), "mode" => mode, "outcome" => outcome
        )
        .increment(1);
        if let Some(took) = acquiring {
            histogram!(
                "tower_batch_lock_acquire_seconds",
                "layer" => layer, "mode" => mode, "outcome" => outcome
            )
            .record(took.as_secs_f64());
        }
    }

    pub(crate) fn batch(layer: &Layer, keys: usize) {
        histogram!("tower_batch_lock_keys", "layer" => label(layer)).record(keys as f64);
    }

    pub(crate) fn waiting(layer: &Layer, by: f64) {
        gauge!("tower_batch_lock_waiting_requests", "layer" => label(layer), "mode" => layer.mode)
            .increment(by);
    }

    pub(crate) fn waited(layer: &Layer, waited: Duration) {
        histogram!("tower_batch_lock_wait_seconds", "layer" => label(layer), "mode" => layer.mode)
            .record(waited.as_secs_f64());
    }

    pub(crate) fn holding(layer: &Layer, by: f64) {
        gauge!("tower_batch_lock_held_batches", "layer" => label(layer)).increment(by);
    }

    pub(crate) fn held(layer: &Layer, held: Duration) {
        histogram!("tower_batch_lock_hold_seconds", "layer" => label(layer))
            .record(held.as_secs_f64());
    }

    pub(crate) fn lease_lost(layer: &Layer) {
        counter!("tower_batch_lock_lost_leases_total", "layer" => label(layer)).increment(1);
    }

    pub(crate) fn release(layer: &Layer, result: &'static str) {
        counter!("tower_batch_lock_release_failures_total", "layer" => label(layer), "result" => result)
            .increment(1);
    }

    #[cfg(feature = "redis")]
    pub(crate) fn node_error(store: &'static str, node: &str, call: &'static str) {
        counter!(
            "tower_batch_lock_node_errors_total",
            "store" => store,
            "node" => node.to_owned(),
            "call" => call
        )
        .increment(1);
    }
}

// Without the feature, recording is nothing at all.
#[cfg(not(feature = "metrics"))]
#[allow(clippy::missing_const_for_fn, unused_variables)]
mod record {
    use super::*;

    pub(crate) fn outcome(layer: &Layer, outcome: Outcome, acquiring: Option<Duration>) {}
    pub(crate) fn batch(layer: &Layer, keys: usize) {}
    pub(crate) fn waiting(layer: &Layer, by: f64) {}
    pub(crate) fn waited(layer: &Layer, waited: Duration) {}
    pub(crate) fn holding(layer: &Layer, by: f64) {}
    pub(crate) fn held(layer: &Layer, held: Duration) {}
    pub(crate) fn lease_lost(layer: &Layer) {}
    pub(crate) fn release(layer: &Layer, result: &'static str) {}
    #[cfg(feature = "redis")]
    pub(crate) fn node_error(store: &'static str, node: &str, call: &'static str) {}
}

#[cfg(feature = "redis")]
pub(crate) use record::node_error;
pub(crate) use record::{batch, held, holding, lease_lost, outcome, release, waited, waiting};

/// Counts a request as waiting while it lives, and then how long it waited.
#[derive(Debug)]
pub(crate) struct Waiting {
    layer: Layer,
    since: std::time::Instant,
}

impl Waiting {
    pub(crate) fn start(layer: &Layer) -> Self {
        waiting(layer, 1.0);
        Self {
            layer: layer.clone(),
            since: std::time::Instant::now(),
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        waiting(&self.layer, -1.0);
        waited(&self.layer, self.since.elapsed());
    }
}
