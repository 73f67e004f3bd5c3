//! What the crate logs, as a `tracing_subscriber::fmt` subscriber writes it.
//!
//! The test binary installs one global subscriber, on first use: a thread-local one
//! (`tracing::subscriber::set_default`) misses events that other tests' threads race it
//! for, through tracing's global cache of which callsites are enabled. It keeps two logs:
//! every warning and error event ([`warnings_logged`], [`errors_logged`]), in which each
//! test looks for the lines of its own routes or keys; and the crate's spans and events at `DEBUG` inside a [`traced`] span
//! ([`traced_logged`]), with a line for each span's close, for the test of the spans
//! themselves, which counts them.

use std::{
    io::Write,
    sync::{Arc, Mutex, OnceLock},
};

use tracing::subscriber::Interest;
use tracing_subscriber::{
    filter::{DynFilterFn, LevelFilter},
    fmt::{self, format::FmtSpan},
    layer::SubscriberExt,
    util::SubscriberInitExt,
    Layer,
};

/// Collects what a subscriber writes.
#[derive(Clone, Default)]
pub(crate) struct Captured(Arc<Mutex<Vec<u8>>>);

impl Captured {
    /// Everything written so far.
    pub(crate) fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }
}

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The name of the span under which [`traced_logged`] logs.
const TRACED: &str = "traced";

/// The two logs of the global subscriber, which the first call installs.
fn logs() -> &'static (Captured, Captured) {
    static LOGS: OnceLock<(Captured, Captured)> = OnceLock::new();
    LOGS.get_or_init(|| {
        let (errors, traced) = (Captured::default(), Captured::default());
        let (errors_writer, traced_writer) = (errors.clone(), traced.clone());
        let errors_layer = fmt::layer()
            .with_writer(move || errors_writer.clone())
            .with_ansi(false)
            .with_filter(LevelFilter::WARN);
        // A `traced` span, and the crate's spans and events at `DEBUG` under it: the only
        // spans this layer sees are those, so any current span is a `traced` one or under it.
        let under_traced = DynFilterFn::new(|metadata, cx| {
            *metadata.level() <= tracing::Level::DEBUG
                && (metadata.name() == TRACED || cx.lookup_current().is_some())
        })
        .with_max_level_hint(LevelFilter::DEBUG)
        .with_callsite_filter(|metadata| {
            if metadata.name() == TRACED || metadata.target().starts_with("tower_batch_lock") {
                Interest::sometimes()
            } else {
                Interest::never()
            }
        });
        let traced_layer = fmt::layer()
            .with_writer(move || traced_writer.clone())
            .with_span_events(FmtSpan::CLOSE)
            .with_ansi(false)
            .with_filter(under_traced);
        tracing_subscriber::registry()
            .with(errors_layer)
            .with(traced_layer)
            .init();
        (errors, traced)
    })
}

/// The error events of this test binary so far, from the global subscriber (installed on
/// the first call), a line each.
pub(crate) fn errors_logged() -> String {
    let logged = warnings_logged();
    logged
        .lines()
        .filter(|line| line.contains(" ERROR "))
        .map(|line| format!("{line}\n"))
        .collect()
}

/// The warning and error events of this test binary so far, as [`errors_logged`].
pub(crate) fn warnings_logged() -> String {
    logs().0.text()
}

/// A span to run requests in: the crate's spans and events under it go to
/// [`traced_logged`] (the global subscriber is installed first).
pub(crate) fn traced() -> tracing::Span {
    logs();
    tracing::info_span!(TRACED)
}

/// What the crate logged at `DEBUG` under [`traced`] spans so far, with a line for the
/// close of each of its spans.
pub(crate) fn traced_logged() -> String {
    logs().1.text()
}
