//! `--backend sim|cuda[:N]`: the device a subcommand runs on, parsed in one place for every subcommand.

use cuvmm::driver::device::DeviceSpec;

/// `sim`, `cuda` (device 0) or `cuda:N`, whether or not this build can open it.
pub fn parse_device(text: &str) -> Result<DeviceSpec, String> {
    let bad = || format!("invalid device `{text}` (expected sim, cuda or cuda:N)");
    match text {
        "sim" => Ok(DeviceSpec::Sim),
        "cuda" => Ok(DeviceSpec::Cuda { ordinal: 0 }),
        _ => {
            let digits = text.strip_prefix("cuda:").ok_or_else(bad)?;
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return Err(bad());
            }
            let ordinal = digits.parse().map_err(|_| bad())?;
            Ok(DeviceSpec::Cuda { ordinal })
        }
    }
}

/// A `--backend` value this build can run on: `cuda` is refused here, with the reason, when the `cuda`
/// feature is off.
pub fn parse_backend(text: &str) -> Result<DeviceSpec, String> {
    let spec = parse_device(text)?;
    spec.check_supported().map_err(|e| e.to_string())?;
    Ok(spec)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sim_cuda_and_cuda_n_and_prints_them_back() {
        assert_eq!(parse_device("sim"), Ok(DeviceSpec::Sim));
        assert_eq!(parse_device("cuda"), Ok(DeviceSpec::Cuda { ordinal: 0 }));
        assert_eq!(parse_device("cuda:3"), Ok(DeviceSpec::Cuda { ordinal: 3 }));
        for spec in [DeviceSpec::Sim, DeviceSpec::Cuda { ordinal: 3 }] {
            assert_eq!(parse_device(&spec.to_string()), Ok(spec));
        }
        assert_eq!(DeviceSpec::Cuda { ordinal: 3 }.to_string(), "cuda:3");
        assert_eq!(DeviceSpec::Sim.to_string(), "sim");
        for bad in [
            "", "gpu", "cuda:", "cuda:x", "cuda:-1", "cuda:+1", "cuda:1:2", "SIM", "cuda0",
        ] {
            let err = parse_device(bad).unwrap_err();
            assert_eq!(
                err,
                format!("invalid device `{bad}` (expected sim, cuda or cuda:N)")
            );
        }
    }

    #[test]
    fn a_backend_this_build_cannot_open_is_refused_with_the_reason() {
        let cuda = parse_backend("cuda:1");
        // The library's support decides, not this crate's feature (a workspace build may give it CUDA).
        if (DeviceSpec::Cuda { ordinal: 1 }).check_supported().is_ok() {
            assert_eq!(cuda, Ok(DeviceSpec::Cuda { ordinal: 1 }));
        } else {
            assert!(cuda.unwrap_err().contains("--features cuda"));
        }
        assert_eq!(parse_backend("sim"), Ok(DeviceSpec::Sim));
    }
}
