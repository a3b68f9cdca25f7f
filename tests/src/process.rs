//! The processes the harness starts (Envoys, the quota service, Redis):
//! each killed when its handle is dropped, and listed while it runs, so
//! that a program built with `panic = "abort"` (the bench, in release),
//! where `Drop` never runs, can still stop them when it panics.

use std::process::{Child, Command, ExitStatus};
use std::sync::Mutex;

/// The ids of the processes started here and not yet stopped.
static RUNNING: Mutex<Vec<u32>> = Mutex::new(Vec::new());

fn running() -> std::sync::MutexGuard<'static, Vec<u32>> {
    RUNNING.lock().unwrap_or_else(|e| e.into_inner())
}

/// A child process, killed (SIGKILL) and reaped when dropped.
#[derive(Debug)]
pub struct Process {
    child: Child,
}

impl Process {
    /// Spawns `command`.
    pub fn spawn(command: &mut Command) -> std::io::Result<Process> {
        let child = command.spawn()?;
        running().push(child.id());
        Ok(Process { child })
    }

    /// Its process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Its exit status, if it has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Sends it `signal` (as the `kill` command names it: `-STOP`, `-CONT`,
    /// `-TERM`); whether that worked.
    pub fn signal(&self, signal: &str) -> bool {
        Command::new("kill").arg(signal).arg(self.id().to_string()).status().is_ok_and(|status| status.success())
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let id = self.child.id();
        running().retain(|&pid| pid != id);
    }
}

/// Makes a panic stop every process the harness started and has not
/// stopped: for programs whose panics abort, where no `Drop` runs and a
/// failed run would leave its Envoys serving.
pub fn stop_processes_on_panic() {
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default_hook(info);
        let pids = running().clone();
        for pid in pids {
            let _ = Command::new("kill").arg(pid.to_string()).status();
        }
    }));
}
