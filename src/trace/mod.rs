//! Workloads, traces and the replay engine (in progress).
