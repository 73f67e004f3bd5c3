//! Errors that come back with every request until the server is fixed (a route set up
//! wrong, a handler that takes a [`Lease`](crate::Lease) where no layer locks, stored
//! answers that this version cannot read): the client's answer says so each time, and the
//! log once a cause (a route) at error level, where the developer looks, its repeats at
//! debug level. A busy route would otherwise write an error line a request.

use std::{
    collections::HashSet,
    sync::{Mutex, PoisonError},
};

/// How many different causes (routes, say) a call site logs at error level; those after
/// them, at debug level only.
const MAX_CAUSES: usize = 1024;

/// The causes a call site of [`error_once_for`] has logged at error level.
pub(crate) struct Logged(Mutex<Option<HashSet<String>>>);

impl Logged {
    pub(crate) const fn new() -> Self {
        Self(Mutex::new(None))
    }

    /// Whether `cause` is logged here for the first time (and there is room to remember it).
    pub(crate) fn first(&self, cause: &str) -> bool {
        let mut logged = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let logged = logged.get_or_insert_with(HashSet::new);
        logged.len() < MAX_CAUSES && !logged.contains(cause) && logged.insert(cause.to_owned())
    }
}

/// `tracing::error!` the first time this call site logs for `cause` (a route, say),
/// `tracing::debug!` after; the error line says that its repeats are at debug level.
macro_rules! error_once_for {
    ($cause:expr, $($arg:tt)+) => {{
        static LOGGED: $crate::log_once::Logged = $crate::log_once::Logged::new();
        if LOGGED.first($cause) {
            ::tracing::error!(repeats = "at debug level", $($arg)+)
        } else {
            ::tracing::debug!($($arg)+)
        }
    }};
}
pub(crate) use error_once_for;

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::{Arc, Mutex};

    use tracing::{Event, Level, Subscriber};
    use tracing_subscriber::{layer::Context, prelude::*, Layer};

    /// The level of every event that `run` logs.
    pub(crate) fn levels_logged(run: impl FnOnce()) -> Vec<Level> {
        let levels = Levels::default();
        let subscriber = tracing_subscriber::registry().with(levels.clone());
        tracing::subscriber::with_default(subscriber, run);
        let logged = levels.0.lock().unwrap().clone();
        logged
    }

    #[derive(Clone, Default)]
    struct Levels(Arc<Mutex<Vec<Level>>>);

    impl<S: Subscriber> Layer<S> for Levels {
        fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
            self.0.lock().unwrap().push(*event.metadata().level());
        }
    }

    #[test]
    fn a_cause_is_logged_at_error_level_once() {
        let logged = levels_logged(|| {
            for route in ["/a", "/a", "/b", "/a", "/b"] {
                error_once_for!(route, route, "misconfigured");
            }
        });
        let (error, debug) = (Level::ERROR, Level::DEBUG);
        assert_eq!(logged, [error, debug, error, debug, debug]);
    }
}
