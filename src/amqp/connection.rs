//! The thread and runtime a lapin connection lives on.
//!
//! A lapin connection is bound to the tokio runtime that created it: its socket is registered
//! with that runtime's reactor and its heartbeats use that runtime's timers. Created on an
//! actix arbiter that later stops (or a test's runtime that ends), it hangs silently: nothing
//! completes while its status still says connected. So each owner (the sink, each inbox link)
//! runs its connection on a [`LinkThread`]: a named thread with a current-thread runtime of its
//! own, which lives exactly as long as its owner. Channels and confirm futures are
//! runtime-agnostic, so the owner publishes and acknowledges from its own arbiter.

use std::future::Future;

use tokio::sync::watch;

/// Why a [`LinkThread`] could not start.
#[derive(Debug, thiserror::Error)]
pub(crate) enum StartError {
    /// The runtime could not be built.
    #[error("could not start the link's runtime: {0}")]
    Runtime(std::io::Error),
    /// The thread could not be spawned.
    #[error("could not start the link's thread: {0}")]
    Thread(std::io::Error),
}

impl StartError {
    /// The operating system's reason, without saying which of the two failed.
    pub(crate) fn io(&self) -> &std::io::Error {
        match self {
            StartError::Runtime(e) | StartError::Thread(e) => e,
        }
    }
}

/// The owner's end of a running link thread. Dropping it tells the thread to stop, as
/// [`LinkThread::stop`] does, without waiting for it.
#[derive(Debug)]
pub(crate) struct LinkThread {
    stop: watch::Sender<bool>,
    /// Becomes true (or its sender goes) when the thread's work has ended.
    closed: watch::Receiver<bool>,
}

/// A runtime on its way to its thread. Should the thread not start, it is dropped on the
/// caller's, which may be inside a runtime, where only a shutdown in the background is allowed.
struct Unstarted(Option<tokio::runtime::Runtime>);

impl Drop for Unstarted {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

/// The thread's end of the stop signal.
#[derive(Debug, Clone)]
pub(crate) struct Stop(watch::Receiver<bool>);

impl Stop {
    /// Resolves once the owner asked to stop or is gone; at once if that already happened, so
    /// it can sit in every `select!` of the thread's work.
    pub(crate) async fn requested(&mut self) {
        let _ = self.0.wait_for(|stop| *stop).await;
    }
}

impl LinkThread {
    /// Starts the thread `name` running `work(stop)` on a current-thread runtime; the work is
    /// expected to close its connection and return once `stop` is requested.
    pub(crate) fn start<F, Fut>(name: &str, work: F) -> Result<Self, StartError>
    where
        F: FnOnce(Stop) -> Fut + Send + 'static,
        Fut: Future<Output = ()>,
    {
        let runtime =
            tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(StartError::Runtime)?;
        let mut runtime = Unstarted(Some(runtime));
        let (stop_tx, stop_rx) = watch::channel(false);
        let (closed_tx, closed_rx) = watch::channel(false);
        std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                if let Some(runtime) = runtime.0.take() {
                    runtime.block_on(work(Stop(stop_rx)));
                }
                let _ = closed_tx.send(true);
            })
            .map_err(StartError::Thread)?;
        Ok(Self { stop: stop_tx, closed: closed_rx })
    }

    /// Asks the thread to close its connection and end.
    pub(crate) fn stop(&self) {
        let _ = self.stop.send(true);
    }

    /// Asks the thread to stop and waits until its work has ended (the connection closed).
    pub(crate) async fn close(&self) {
        self.stop();
        let mut closed = self.closed.clone();
        // An error means the thread is gone, which is what we wait for.
        let _ = closed.wait_for(|closed| *closed).await;
    }
}
