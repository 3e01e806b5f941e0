//! The thread that drives the PostgreSQL connections this crate opens.
//!
//! tokio-postgres splits a connection in two: the client, which queries go through from any
//! runtime, and the driver, a task that owns the socket. Spawned on the caller's runtime, the
//! driver dies with it: a pool shared with an actix-web app gets connections opened by its HTTP
//! workers, whose runtimes stop at shutdown before the dispatcher drains, and every query on
//! those connections then fails as if the database were gone. So every connection is opened,
//! and its driver runs, on a runtime of the crate's own, on a thread that lives as long as the
//! process (`actix-outbox-pg`): a connection works wherever it is used, for as long as it is
//! open.

use std::future::Future;
use std::sync::OnceLock;

use tokio::runtime::Handle;

/// The connections' runtime, started by the first connection.
static RUNTIME: OnceLock<Result<Handle, String>> = OnceLock::new();

fn handle() -> Result<&'static Handle, std::io::Error> {
    RUNTIME
        .get_or_init(|| {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| format!("cannot start the runtime of the database connections: {e}"))?;
            let handle = runtime.handle().clone();
            std::thread::Builder::new()
                .name("actix-outbox-pg".into())
                .spawn(move || runtime.block_on(std::future::pending::<()>()))
                .map_err(|e| format!("cannot start the thread of the database connections: {e}"))?;
            Ok(handle)
        })
        .as_ref()
        .map_err(|e| std::io::Error::other(e.clone()))
}

/// Runs `work` (opening a connection, which spawns its driver) on the connections' runtime and
/// waits for it; dropping the wait (a timeout) cancels the work.
pub(super) async fn on_connection_runtime<F>(work: F) -> Result<F::Output, std::io::Error>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    struct AbortOnDrop(tokio::task::AbortHandle);
    impl Drop for AbortOnDrop {
        fn drop(&mut self) {
            self.0.abort();
        }
    }
    let task = handle()?.spawn(work);
    let _abort = AbortOnDrop(task.abort_handle());
    task.await.map_err(|e| std::io::Error::other(format!("opening the connection failed: {e}")))
}

/// Runs `work` on the connections' runtime without waiting for it (a cancel request for a
/// statement given up on, which must not hold up its caller). Nothing happens if that runtime
/// cannot start.
pub(super) fn detach<F>(work: F)
where
    F: Future<Output = ()> + Send + 'static,
{
    if let Ok(handle) = handle() {
        drop(handle.spawn(work));
    }
}
