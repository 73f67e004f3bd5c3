//! The longest duration a setting takes.

use std::time::Duration;

/// A century. A setting longer than this (a TTL, a wait, a timeout, `Duration::MAX` for
/// "no limit") counts as this long: as good as forever for a lock, and every deadline
/// computed from it (`Instant::now() + d`, milliseconds in Redis and Lua) stays
/// representable, where `Duration::MAX` overflowed them and panicked requests.
pub(crate) const LONGEST: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);

/// `duration`, at most [`LONGEST`]: what every setter of a duration keeps.
pub(crate) const fn capped(duration: Duration) -> Duration {
    if duration.as_secs() >= LONGEST.as_secs() {
        LONGEST
    } else {
        duration
    }
}
