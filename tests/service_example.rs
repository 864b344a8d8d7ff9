//! Runs `examples/service.rs` on the simulated device, in this process (the example's own code, included
//! as a module), and checks what it prints: every worker served its requests, every buffer handed to
//! another stream was taken over there, nothing was left allocated or deferred, the invariants held
//! (the example checks them and fails otherwise), `memory_summary()` is there, and `empty_cache` gave
//! everything back.

#[allow(dead_code)]
#[path = "../examples/service.rs"]
mod service;

fn run(args: &[&str]) -> Result<String, String> {
    let opts = service::parse(args.iter().map(|s| s.to_string()))?;
    service::run(opts)
}

/// The number after `label` in `text`.
fn number_after(text: &str, label: &str) -> u64 {
    let at = text
        .find(label)
        .unwrap_or_else(|| panic!("no `{label}` in:\n{text}"))
        + label.len();
    let digits: String = text[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits
        .parse()
        .unwrap_or_else(|_| panic!("no number after `{label}` in:\n{text}"))
}

#[test]
fn the_simulated_service_serves_every_request_and_gives_everything_back() {
    let text =
        run(&["--workers", "3", "--requests", "120", "--seed", "7"]).expect("the service ran");
    assert!(
        text.starts_with("service on the simulated device"),
        "{text}"
    );
    assert_eq!(number_after(&text, "requests served: "), 3 * 120);
    // Every fourth request of each worker is handed to the next worker, which takes each over.
    assert_eq!(
        number_after(&text, "buffers handed between streams: "),
        3 * 30
    );
    let rows: Vec<&str> = text
        .lines()
        .skip_while(|l| !l.starts_with("worker"))
        .skip(1)
        .take(3)
        .collect();
    for row in &rows {
        let cols: Vec<u64> = row.split_whitespace().map(|c| c.parse().unwrap()).collect();
        assert_eq!(cols[1], 120, "{row}");
        assert_eq!((cols[3], cols[4]), (30, 30), "handed over, adopted: {row}");
    }
    assert!(number_after(&text, "peak allocated: ") > 0);
    assert!(number_after(&text, "peak reserved: ") >= number_after(&text, "peak allocated: "));
    assert_eq!(number_after(&text, "now allocated: "), 0);
    assert_eq!(number_after(&text, "OOMs: "), 0);
    assert!(text.contains("cuvmm CUDA memory summary"), "{text}");
    assert!(text.contains("Allocated memory"), "{text}");
    assert_eq!(number_after(&text, "after empty_cache: "), 0);
}

#[test]
fn bad_options_are_errors_and_cuda_without_a_driver_is_a_message() {
    assert!(run(&["--workers"]).is_err());
    assert!(
        run(&["--backend", "gpu"])
            .unwrap_err()
            .contains("sim, cuda or cuda:N")
    );
    assert!(
        run(&["--frobnicate", "1"])
            .unwrap_err()
            .contains("unknown option")
    );
    // On this machine: either a GPU runs it, or the reason none can is said (never a panic).
    match run(&["--backend", "cuda", "--workers", "2", "--requests", "16"]) {
        Ok(text) => assert!(text.contains("kernel results checked"), "{text}"),
        Err(err) => assert!(err.contains("no CUDA driver found"), "{err}"),
    }
}
