//! How an error is printed for a person: its message, then each source's, joined by ": ".
//!
//! Messages never interpolate their source (it is a `#[source]`), so walking the chain once says
//! everything exactly once. Every place that turns an error into text for a person — a CLI's
//! one-line error, a kubelet response, a log field — goes through [`chain`], in the library and
//! in the drivers built on it.

use std::error::Error;
use std::fmt;

/// Displays `e` and its sources, `outer: inner: innermost`.
pub fn chain<'a>(e: &'a (dyn Error + 'static)) -> Chain<'a> {
    Chain(e)
}

/// See [`chain`].
#[derive(Clone, Copy)]
pub struct Chain<'a>(&'a (dyn Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut next = self.0.source();
        while let Some(cause) = next {
            write!(f, ": {cause}")?;
            next = cause.source();
        }
        Ok(())
    }
}

impl fmt::Debug for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    #[derive(Debug, thiserror::Error)]
    #[error("cannot read the checkpoint {path}")]
    struct Read {
        path: &'static str,
        source: std::io::Error,
    }

    #[derive(Debug, thiserror::Error)]
    enum Outer {
        #[error("cannot start")]
        Start(#[source] Read),
        #[error(transparent)]
        Through(Read),
    }

    #[test]
    fn each_cause_is_said_once_in_order() {
        let read = || Read {
            path: "/p/checkpoint.json",
            source: std::io::Error::from_raw_os_error(28),
        };
        let e = Outer::Start(read());
        assert_eq!(
            super::chain(&e).to_string(),
            "cannot start: cannot read the checkpoint /p/checkpoint.json: \
             No space left on device (os error 28)"
        );
        // A transparent wrapper adds nothing and loses nothing.
        let e = Outer::Through(read());
        assert_eq!(
            super::chain(&e).to_string(),
            "cannot read the checkpoint /p/checkpoint.json: No space left on device (os error 28)"
        );
    }
}
