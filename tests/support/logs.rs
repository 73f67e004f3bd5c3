//! What the crate logs, as a `tracing_subscriber::fmt` subscriber writes it.
//!
//! A test binary that reads logs installs one global subscriber: a thread-local one
//! (`tracing::subscriber::set_default`) misses events that other tests' threads race it
//! for. So each test looks for the lines of its own routes or keys.

use std::{
    io::Write,
    sync::{Arc, Mutex, OnceLock},
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

/// The error events of this test binary so far, from a global subscriber installed on the
/// first call.
pub(crate) fn errors_logged() -> String {
    static CAPTURED: OnceLock<Captured> = OnceLock::new();
    CAPTURED
        .get_or_init(|| {
            let captured = Captured::default();
            let writer = captured.clone();
            tracing_subscriber::fmt()
                .with_writer(move || writer.clone())
                .with_max_level(tracing::Level::ERROR)
                .with_ansi(false)
                .init();
            captured
        })
        .text()
}
