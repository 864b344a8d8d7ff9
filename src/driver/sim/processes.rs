//! Several processes on one simulated device ([`SimDriver::another_process`]): each has its own address
//! space, handles and counters, and they share the device's memory, so that what one holds is missing from
//! what the others may create (an inference engine and a trainer taking turns on one GPU).
//!
//! Each process publishes the bytes it holds after every call that changes them; a process's free memory is
//! the capacity less its own bytes and the others' published ones.

use super::SimDriver;
use crate::base::sync::{Arc, Mutex};

/// The bytes each process on the device holds.
#[derive(Debug, Default)]
struct Machine {
    used: Mutex<Vec<u64>>,
}

/// One process's place on a shared device.
#[derive(Debug)]
pub(super) struct Process {
    machine: Arc<Machine>,
    slot: usize,
}

impl Process {
    /// A new process on `machine`.
    fn join(machine: &Arc<Machine>) -> Self {
        let mut used = machine.used.lock();
        used.push(0);
        Self {
            machine: Arc::clone(machine),
            slot: used.len() - 1,
        }
    }

    /// Bytes the other processes hold.
    pub(super) fn others(&self) -> u64 {
        let used = self.machine.used.lock();
        let all: u64 = used.iter().sum();
        all - used[self.slot]
    }

    /// Publishes that this process holds `bytes`.
    fn publish(&self, bytes: u64) {
        self.machine.used.lock()[self.slot] = bytes;
    }
}

impl Drop for Process {
    /// A process that ends gives its memory back to the device.
    fn drop(&mut self) {
        self.publish(0);
    }
}

impl SimDriver {
    /// Another process on this device (`cuInit` in a second process): a simulator of the same
    /// configuration, with its own address space, handles, streams and counters, that shares this device's
    /// memory. Each one's [`free_bytes`](Self::free_bytes) (and so `mem_info` and what `create` can make)
    /// leaves out what the others hold. A test control.
    pub fn another_process(&mut self) -> SimDriver {
        if self.process.is_none() {
            let machine = Arc::new(Machine::default());
            self.process = Some(Process::join(&machine));
            self.publish();
        }
        let machine = &self.process.as_ref().expect("set above").machine;
        let mut other = SimDriver::new(self.config.clone());
        other.process = Some(Process::join(machine));
        other
    }

    /// Tells the other processes what this one holds now (nothing to do without any).
    pub(super) fn publish(&self) {
        if let Some(process) = &self.process {
            process.publish(self.used_bytes());
        }
    }
}
