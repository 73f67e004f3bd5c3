//! What the layer records through the [`metrics`] facade (feature `metrics`, on by
//! default): the application installs a recorder (a Prometheus exporter, say), and without
//! one, recording costs next to nothing. Names and units follow Prometheus's conventions.
//! Label values are a layer's name or route, fixed words and Redlock masters' addresses:
//! never keys, which are unbounded and may be secrets.

use std::{
    fmt,
    sync::{Arc, OnceLock},
    time::Duration,
};

use crate::store::contract::{Mode, Modes};

/// The labels of a request's metrics: `layer`, the name given to its layer
/// ([`Locks::metrics_label`](crate::Locks::metrics_label)), else the route it matched, else
/// `unnamed`; and `mode`, how its batch is held (`exclusive`, `shared` or `mixed`), on the
/// series where readers and writers differ: acquisitions, their time and the waiting.
///
/// Cheap to clone: the series of a `layer` label are registered with the recorder once, on
/// their first use, and kept (see [`Labels`]).
#[derive(Debug, Clone)]
pub(crate) struct Layer {
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    series: Arc<Series>,
    mode: HeldAs,
}

/// The `mode` label.
#[derive(Debug, Clone, Copy)]
enum HeldAs {
    Exclusive,
    Shared,
    Mixed,
}

impl HeldAs {
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    const ALL: usize = 3;

    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    fn as_str(self) -> &'static str {
        match self {
            Self::Exclusive => "exclusive",
            Self::Shared => "shared",
            Self::Mixed => "mixed",
        }
    }
}

impl Layer {
    /// The label of what no name or route names (a handler's `Lease::lock`, a service
    /// outside an axum router). Not kept: it serves rare events only.
    pub(crate) fn unnamed() -> Self {
        Self {
            series: Arc::new(Series::new(UNNAMED)),
            mode: HeldAs::Exclusive,
        }
    }

    /// The same labels, for a batch held in `modes`.
    pub(crate) fn holding(mut self, modes: &Modes) -> Self {
        self.mode = match modes {
            Modes::All(Mode::Exclusive) => HeldAs::Exclusive,
            Modes::All(Mode::Shared) => HeldAs::Shared,
            Modes::Each(_) => HeldAs::Mixed,
        };
        self
    }
}

const UNNAMED: &str = "unnamed";

/// The `layer` labels of one [`LockService`](crate::LockService) and its clones, and their
/// series. A service serves one route (axum gives each route its own), so the series of
/// the first label it sees are kept, and a request finds them with a comparison. Building
/// each metric's key (and allocating its labels) for every request cost about 0.4 µs a
/// request without a recorder and 2 µs with one. A request under another label (a service
/// in front of a whole router) gets series of its own.
///
/// Kept series stay registered with the recorder that was installed when they were first
/// used: install the recorder before the first request, as every exporter's setup does.
#[derive(Debug, Default)]
pub(crate) struct Labels {
    first: OnceLock<Arc<Series>>,
}

impl Labels {
    /// The labels of a request named `name` (the layer's, else its route's); `shared` when
    /// the layer holds every key shared, before the batch is known (a refused request
    /// counts under it).
    pub(crate) fn of(&self, name: Option<&str>, shared: bool) -> Layer {
        let name = name.unwrap_or(UNNAMED);
        let first = self.first.get_or_init(|| Arc::new(Series::new(name)));
        let series = if *first.name == *name {
            first.clone()
        } else {
            Arc::new(Series::new(name))
        };
        let mode = if shared {
            HeldAs::Shared
        } else {
            HeldAs::Exclusive
        };
        Layer { series, mode }
    }
}

/// The metrics of one `layer` label, each registered on its first use.
struct Series {
    name: Box<str>,
    #[cfg(feature = "metrics")]
    handles: record::Handles,
}

impl Series {
    fn new(name: &str) -> Self {
        Self {
            name: name.into(),
            #[cfg(feature = "metrics")]
            handles: record::Handles::default(),
        }
    }
}

impl fmt::Debug for Series {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Series").field(&self.name).finish()
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
    /// Dropped before its answer: its client went away, or a timeout around the layer
    /// gave up on it, most often while it waited.
    Abandoned,
}

impl Outcome {
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    const ALL: usize = 5;

    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    fn as_str(self) -> &'static str {
        match self {
            Self::Granted => "granted",
            Self::Contended => "contended",
            Self::Unavailable => "unavailable",
            Self::Rejected => "rejected",
            Self::Abandoned => "abandoned",
        }
    }
}

#[cfg(feature = "metrics")]
mod record {
    use metrics::{counter, gauge, histogram, Counter, Gauge, Histogram};

    use super::*;

    /// A label's handles, indexed `[mode]` and `[mode][outcome]` in the enums' order.
    #[derive(Default)]
    pub(super) struct Handles {
        acquisitions: [[OnceLock<Counter>; Outcome::ALL]; HeldAs::ALL],
        acquire_seconds: [[OnceLock<Histogram>; Outcome::ALL]; HeldAs::ALL],
        waiting: [OnceLock<Gauge>; HeldAs::ALL],
        wait_seconds: [OnceLock<Histogram>; HeldAs::ALL],
        keys: OnceLock<Histogram>,
        held_batches: OnceLock<Gauge>,
        hold_seconds: OnceLock<Histogram>,
        lost_leases: OnceLock<Counter>,
        /// `retried`, then `gave_up`.
        release_failures: [OnceLock<Counter>; 2],
    }

    /// The `layer` label's value, for a handle's first registration.
    fn name(layer: &Layer) -> String {
        layer.series.name.to_string()
    }

    fn handles(layer: &Layer) -> &Handles {
        &layer.series.handles
    }

    pub(crate) fn outcome(layer: &Layer, outcome: Outcome, acquiring: Option<Duration>) {
        let mode = layer.mode;
        let (m, o) = (mode as usize, outcome as usize);
        handles(layer).acquisitions[m][o]
            .get_or_init(|| {
                counter!(
                    "tower_batch_lock_acquisitions_total",
                    "layer" => name(layer), "mode" => mode.as_str(), "outcome" => outcome.as_str()
                )
            })
            .increment(1);
        if let Some(took) = acquiring {
            handles(layer).acquire_seconds[m][o]
                .get_or_init(|| {
                    histogram!(
                        "tower_batch_lock_acquire_seconds",
                        "layer" => name(layer), "mode" => mode.as_str(), "outcome" => outcome.as_str()
                    )
                })
                .record(took.as_secs_f64());
        }
    }

    pub(crate) fn batch(layer: &Layer, keys: usize) {
        handles(layer)
            .keys
            .get_or_init(|| histogram!("tower_batch_lock_keys", "layer" => name(layer)))
            .record(keys as f64);
    }

    pub(crate) fn waiting(layer: &Layer, by: f64) {
        let mode = layer.mode;
        handles(layer).waiting[mode as usize]
            .get_or_init(|| {
                gauge!("tower_batch_lock_waiting_requests", "layer" => name(layer), "mode" => mode.as_str())
            })
            .increment(by);
    }

    pub(crate) fn waited(layer: &Layer, waited: Duration) {
        let mode = layer.mode;
        handles(layer).wait_seconds[mode as usize]
            .get_or_init(|| {
                histogram!("tower_batch_lock_wait_seconds", "layer" => name(layer), "mode" => mode.as_str())
            })
            .record(waited.as_secs_f64());
    }

    pub(crate) fn holding(layer: &Layer, by: f64) {
        handles(layer)
            .held_batches
            .get_or_init(|| gauge!("tower_batch_lock_held_batches", "layer" => name(layer)))
            .increment(by);
    }

    pub(crate) fn held(layer: &Layer, held: Duration) {
        handles(layer)
            .hold_seconds
            .get_or_init(|| histogram!("tower_batch_lock_hold_seconds", "layer" => name(layer)))
            .record(held.as_secs_f64());
    }

    pub(crate) fn lease_lost(layer: &Layer) {
        handles(layer)
            .lost_leases
            .get_or_init(|| counter!("tower_batch_lock_lost_leases_total", "layer" => name(layer)))
            .increment(1);
    }

    pub(crate) fn release(layer: &Layer, result: ReleaseFailure) {
        handles(layer).release_failures[result as usize]
            .get_or_init(|| {
                counter!(
                    "tower_batch_lock_release_failures_total",
                    "layer" => name(layer), "result" => result.as_str()
                )
            })
            .increment(1);
    }

    #[cfg(feature = "redis")]
    pub(crate) fn connection_opened() {
        counter!("tower_batch_lock_store_connections_total").increment(1);
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
    pub(crate) fn release(layer: &Layer, result: ReleaseFailure) {}
    #[cfg(feature = "redis")]
    pub(crate) fn node_error(store: &'static str, node: &str, call: &'static str) {}
    #[cfg(feature = "redis")]
    pub(crate) fn connection_opened() {}
}

pub(crate) use record::{batch, held, holding, lease_lost, outcome, release, waited, waiting};
#[cfg(feature = "redis")]
pub(crate) use record::{connection_opened, node_error};

/// What became of a release that failed: the `result` label.
#[derive(Debug, Clone, Copy)]
pub(crate) enum ReleaseFailure {
    /// It is tried again.
    Retried,
    /// No more tries: the keys expire with their TTL.
    GaveUp,
}

impl ReleaseFailure {
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    fn as_str(self) -> &'static str {
        match self {
            Self::Retried => "retried",
            Self::GaveUp => "gave_up",
        }
    }
}

/// Counts an acquisition that is dropped before its answer as [abandoned](Outcome::Abandoned),
/// with the time it took until then: every request that reached the layer with keys
/// counts under one outcome.
#[derive(Debug)]
pub(crate) struct Unanswered<'a> {
    layer: &'a Layer,
    since: std::time::Instant,
}

impl<'a> Unanswered<'a> {
    pub(crate) fn new(layer: &'a Layer, since: std::time::Instant) -> Self {
        Self { layer, since }
    }

    /// The acquisition has its answer, which the caller records.
    pub(crate) fn answered(self) {
        std::mem::forget(self);
    }
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        outcome(self.layer, Outcome::Abandoned, Some(self.since.elapsed()));
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_label_is_kept_and_others_get_series_of_their_own() {
        let labels = Labels::default();
        let first = labels.of(Some("/orders/{id}"), false);
        let other = labels.of(Some("/quotes"), true);
        let again = labels.of(Some("/orders/{id}"), false);
        assert!(Arc::ptr_eq(&first.series, &again.series));
        assert_eq!(&*other.series.name, "/quotes");
        assert!(!Arc::ptr_eq(&first.series, &other.series));
        assert_eq!(other.mode.as_str(), "shared");
        assert_eq!(&*labels.of(None, false).series.name, "unnamed");
    }
}
