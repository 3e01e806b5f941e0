//! What the sink and the inbox both need from AMQP, written once: the thread and runtime that
//! own a lapin connection ([`connection`]), its bounded close ([`connection_closer`]), the
//! reconnect backoff, and how a broker's confirm reads ([`publisher_confirm`]). Split like
//! lapin's own modules so that each piece sits next to the lapin type it wraps.

pub(crate) mod connection;
pub(crate) mod connection_closer;
pub(crate) mod publisher_confirm;

use std::time::Duration;

use crate::backoff::half_jitter;
use crate::url::mask_url;

/// Checks that `url` parses as an AMQP URL; the error names it with its password masked, and
/// so does lapin's reason, which quotes the URL as given.
pub(crate) fn check_url(url: &str) -> Result<(), String> {
    url.parse::<lapin::uri::AMQPUri>().map(drop).map_err(|e| {
        let masked = mask_url(url);
        format!("malformed AMQP URL {masked:?}: {}", e.replace(url, &masked))
    })
}

/// The pause before the next attempt to (re)connect: it doubles with every failure since the
/// last link that held, from `min` up to `max`, drawn from its upper half so that a fleet that
/// lost the same broker does not come back in step.
#[derive(Debug)]
pub(crate) struct Reconnect {
    min: Duration,
    max: Duration,
    failures: i32,
}

impl Reconnect {
    pub(crate) fn new(min: Duration, max: Duration) -> Self {
        Self { min, max, failures: 0 }
    }

    /// A link was lost after it `held` this long: one that held for a while (at least the
    /// longest pause) was no flapping, so the backoff starts afresh.
    pub(crate) fn lost_after(&mut self, held: Duration) {
        if held >= self.max {
            self.failures = 0;
        }
    }

    /// Counts one more failure and returns the pause before the next attempt.
    pub(crate) fn next_delay(&mut self) -> Duration {
        self.failures = self.failures.saturating_add(1);
        half_jitter(self.failures - 1, self.min, self.max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_urls_do_not_show_the_password() {
        let e = check_url("amqp:guest:s3cret@rabbit").unwrap_err();
        assert!(!e.contains("s3cret"), "{e}");
        assert!(e.starts_with("malformed AMQP URL"), "{e}");
        assert!(check_url("amqp://guest:guest@127.0.0.1:5672/%2f").is_ok());
    }

    #[test]
    fn backoff_grows_and_restarts_after_a_link_that_held() {
        let (min, max) = (Duration::from_millis(100), Duration::from_secs(10));
        let mut reconnect = Reconnect::new(min, max);
        assert!(reconnect.next_delay() <= min);
        for _ in 0..10 {
            reconnect.next_delay();
        }
        assert!(reconnect.next_delay() >= max / 2);
        reconnect.lost_after(Duration::from_secs(1));
        assert!(reconnect.next_delay() >= max / 2, "a short-lived link keeps the backoff");
        reconnect.lost_after(max);
        assert!(reconnect.next_delay() <= min);
    }
}
