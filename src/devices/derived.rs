//! Peak figures of a card the catalogue lacks, from what NVML reports of it: SMs, clocks and
//! memory bus, times what one SM does per clock on its architecture.
//!
//! FLOP per SM per clock, dense, tensor figures with fp32 accumulate (what PyTorch uses), as
//! the NVIDIA architecture whitepapers give them (peak TFLOP/s / (SMs x boost clock)):
//!
//! | compute capability | architecture | fp32 | tf32 | fp16, bf16 | fp8 | warps/SM | source |
//! |---|---|---|---|---|---|---|---|
//! | 7.0 | Volta (V100) | 128 | - | 1,024 (fp16 only) | - | 64 | Volta whitepaper |
//! | 7.5 | Turing (T4) | 128 | - | 1,024 (fp16 only) | - | 32 | Turing whitepaper |
//! | 8.0 | Ampere GA100 (A100) | 128 | 1,024 | 2,048 | - | 64 | A100 whitepaper |
//! | 8.6 | Ampere GA10x (A10, A40) | 256 | 512 | 1,024 | - | 48 | GA102 whitepaper |
//! | 8.9 | Ada (L4, L40S) | 256 | 512 | 1,024 | 2,048 | 48 | Ada whitepaper |
//! | 9.0 | Hopper (H100) | 256 | 2,048 | 4,096 | 8,192 | 64 | H100 whitepaper |
//! | 10.0 | Blackwell (B200) | 256 | 4,096 | 8,192 | 16,384 | 64 | approximate: B200 data sheet |
//! | 12.0 | Blackwell (RTX 50, RTX PRO) | 256 | 512 | 1,024 | 2,048 | 48 | approximate: as Ada |
//!
//! GeForce cards (the driver's name says `GeForce`) of 7.5, 8.6, 8.9 and 12.0 run tensor
//! instructions with fp32 accumulate at half these rates (the GA102 and Ada whitepapers' GeForce
//! columns), so their tensor figures are halved. Blackwell's rows are inferred from data-sheet
//! peaks and are approximate. Other capabilities give no figures (`None`).
//!
//! Bandwidth = 2 x memory clock x bus width / 8: NVML's memory clock is the base of a double
//! data rate (an A100 40GB reports 1,215 MHz on 5,120 bits: 1,555 GB/s; a T4 5,001 MHz on 256
//! bits: 320 GB/s).

use crate::devices::performance::GpuPerformance;
use crate::devices::GpuDevice;

/// What one SM does per clock.
#[derive(Debug, Clone, Copy, PartialEq)]
struct PerSm {
    fp32: f64,
    tf32: Option<f64>,
    fp16: f64,
    bf16: Option<f64>,
    fp8: Option<f64>,
    max_warps: u32,
    /// fp32 lanes (CUDA cores) per SM: SMs from NVML's core count.
    cores: u32,
    /// Whether GeForce cards of this architecture halve the fp32-accumulate tensor rate.
    geforce_halves: bool,
}

fn per_sm(compute_capability: &str) -> Option<PerSm> {
    let row = |fp32: f64,
               tf32: Option<f64>,
               fp16: f64,
               bf16: Option<f64>,
               fp8: Option<f64>,
               max_warps: u32,
               geforce_halves: bool| PerSm {
        fp32,
        tf32,
        fp16,
        bf16,
        fp8,
        max_warps,
        cores: (fp32 / 2.0) as u32,
        geforce_halves,
    };
    Some(match compute_capability {
        "7.0" => row(128.0, None, 1024.0, None, None, 64, false),
        "7.5" => row(128.0, None, 1024.0, None, None, 32, true),
        "8.0" => row(128.0, Some(1024.0), 2048.0, Some(2048.0), None, 64, false),
        "8.6" => row(256.0, Some(512.0), 1024.0, Some(1024.0), None, 48, true),
        "8.9" => row(
            256.0,
            Some(512.0),
            1024.0,
            Some(1024.0),
            Some(2048.0),
            48,
            true,
        ),
        "9.0" => row(
            256.0,
            Some(2048.0),
            4096.0,
            Some(4096.0),
            Some(8192.0),
            64,
            false,
        ),
        "10.0" => row(
            256.0,
            Some(4096.0),
            8192.0,
            Some(8192.0),
            Some(16384.0),
            64,
            false,
        ),
        "12.0" => row(
            256.0,
            Some(512.0),
            1024.0,
            Some(1024.0),
            Some(2048.0),
            48,
            true,
        ),
        _ => return None,
    })
}

/// SMs from NVML's CUDA core count, for drivers that give cores but not SMs.
pub fn sm_count_from_cores(compute_capability: &str, cores: u32) -> Option<u32> {
    let per = per_sm(compute_capability)?;
    (cores > 0 && cores.is_multiple_of(per.cores)).then_some(cores / per.cores)
}

/// DRAM bandwidth, GB/s, of a double-data-rate memory at `clock_mhz` on `bus_bits`.
pub fn bandwidth_gb_s(clock_mhz: u32, bus_bits: u32) -> f64 {
    2.0 * f64::from(clock_mhz) * 1e6 * f64::from(bus_bits) / 8.0 / 1e9
}

/// Peaks of `device` from its NVML figures; `None` when the driver did not give SMs, clocks,
/// bus width and compute capability, or the architecture is not in the table.
pub fn performance_of(device: &GpuDevice) -> Option<GpuPerformance> {
    let per = per_sm(device.compute_capability.as_deref()?)?;
    let sms = device.multiprocessor_count.filter(|&n| n > 0)?;
    let clock = device.max_sm_clock_mhz.filter(|&c| c > 0)?;
    let memory_clock = device.max_memory_clock_mhz.filter(|&c| c > 0)?;
    let bus = device.memory_bus_width_bits.filter(|&b| b > 0)?;
    let tensor = if per.geforce_halves && device.name.to_ascii_lowercase().contains("geforce") {
        0.5
    } else {
        1.0
    };
    let tflops = |per_clock: f64| f64::from(sms) * per_clock * f64::from(clock) * 1e6 / 1e12;
    Some(GpuPerformance {
        sm_count: sms,
        max_warps_per_sm: per.max_warps,
        boost_clock_mhz: clock,
        memory_bandwidth_gb_s: bandwidth_gb_s(memory_clock, bus),
        fp32_tflops: tflops(per.fp32),
        tf32_tflops: per.tf32.map(|r| tflops(r * tensor)),
        fp16_tflops: tflops(per.fp16 * tensor),
        bf16_tflops: per.bf16.map(|r| tflops(r * tensor)),
        fp8_tflops: per.fp8.map(|r| tflops(r * tensor)),
        // NVML's link figures are not read: taken as PCIe 4.0 x16.
        interconnect_gb_s: super::performance::DEFAULT_INTERCONNECT_GB_S,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::sku::Catalogue;
    use crate::devices::{FakeDevices, GpuDevices};

    fn close(a: f64, b: f64, tolerance: f64) -> bool {
        (a - b).abs() <= tolerance * b.abs()
    }

    /// The table reproduces the data-sheet peaks of catalogue cards from their NVML figures.
    #[test]
    fn nvml_figures_of_known_cards_give_their_data_sheet_peaks() {
        let cases = [
            // name, cc, SMs, SM clock, memory clock, bus, catalogue id
            (
                "NVIDIA A100-SXM4-40GB",
                "8.0",
                108,
                1410,
                1215,
                5120,
                "a100-40gb",
            ),
            ("Tesla T4", "7.5", 40, 1590, 5001, 256, "t4"),
            (
                "NVIDIA GeForce RTX 4090",
                "8.9",
                128,
                2520,
                10501,
                384,
                "rtx-4090",
            ),
            (
                "NVIDIA GeForce RTX 3090",
                "8.6",
                82,
                1695,
                9751,
                384,
                "rtx-3090",
            ),
            ("NVIDIA L4", "8.9", 58, 2040, 6251, 192, "l4"),
        ];
        for (name, cc, sms, clock, memory_clock, bus, id) in cases {
            let mut device = GpuDevice::new(0, "GPU-x", name, 1);
            device.compute_capability = Some(cc.into());
            device.multiprocessor_count = Some(sms);
            device.max_sm_clock_mhz = Some(clock);
            device.max_memory_clock_mhz = Some(memory_clock);
            device.memory_bus_width_bits = Some(bus);
            let derived = performance_of(&device).unwrap();
            let sheet = Catalogue::builtin().by_id(id).unwrap().performance;
            assert!(
                close(derived.fp32_tflops, sheet.fp32_tflops, 0.02),
                "{name}: {derived:?}"
            );
            assert!(
                close(derived.fp16_tflops, sheet.fp16_tflops, 0.02),
                "{name}: {derived:?}"
            );
            assert!(
                close(
                    derived.memory_bandwidth_gb_s,
                    sheet.memory_bandwidth_gb_s,
                    0.02
                ),
                "{name}: {derived:?}"
            );
            assert_eq!(derived.max_warps_per_sm, sheet.max_warps_per_sm, "{name}");
            assert_eq!(derived.tf32_tflops.is_some(), sheet.tf32_tflops.is_some());
            assert_eq!(derived.fp8_tflops.is_some(), sheet.fp8_tflops.is_some());
        }
    }

    /// A typo in data/gpus.json shows as a peak far from SMs x clock x the table's rate. The
    /// exceptions are cards whose data sheets give less than their clock would: the H20 (cut
    /// for export), the L40 (half-rate fp32 accumulate), the H100 NVL (power-limited tensor
    /// clock), and the A10G (no NVIDIA data sheet). Hopper data sheets give tensor peaks at a
    /// lower clock than the boost clock (H100 SXM: 989 of 1,070 TFLOP/s): 10 % is allowed.
    #[test]
    fn catalogue_peaks_agree_with_the_architecture_table() {
        // NVML and this table are NVIDIA's; AMD cards carry their datasheet peaks only.
        let nvidia = Catalogue::builtin()
            .all()
            .iter()
            .filter(|s| s.vendor == crate::devices::sku::Vendor::Nvidia);
        for sku in nvidia {
            let p = sku.performance;
            let mut device = GpuDevice::new(0, "GPU-x", sku.name.as_str(), sku.capacity_mib);
            device.compute_capability = Some(sku.compute_capability.clone());
            device.multiprocessor_count = Some(p.sm_count);
            device.max_sm_clock_mhz = Some(p.boost_clock_mhz);
            device.max_memory_clock_mhz = Some(1000);
            device.memory_bus_width_bits = Some(1024);
            let derived =
                performance_of(&device).expect("every catalogue architecture is in the table");
            assert_eq!(derived.max_warps_per_sm, p.max_warps_per_sm, "{}", sku.id);
            if ["h20", "a10g"].contains(&sku.id.as_str()) {
                continue;
            }
            assert!(
                close(derived.fp32_tflops, p.fp32_tflops, 0.03),
                "{}: {derived:?}",
                sku.id
            );
            if ["l40", "h100-nvl"].contains(&sku.id.as_str()) {
                continue;
            }
            assert!(
                close(derived.fp16_tflops, p.fp16_tflops, 0.1),
                "{}: {derived:?}",
                sku.id
            );
            assert_eq!(
                derived.fp8_tflops.is_some(),
                p.fp8_tflops.is_some(),
                "{}",
                sku.id
            );
        }
    }

    #[test]
    fn a_scripted_unknown_card_gets_derived_peaks_and_missing_figures_give_none() {
        let fake = FakeDevices::single("NVIDIA RTX PRO 6000 Blackwell", 97_887).with_hardware(
            Some("12.0"),
            Some(188),
            Some(2617),
            Some(14_001),
            Some(512),
        );
        let device = fake.attached().unwrap();
        assert_eq!(device.sku, None);
        let derived = performance_of(&device).unwrap();
        // 188 x 256 x 2,617 MHz = 125.9 TFLOP/s fp32; 2 x 14,001 MHz x 512 bits / 8 = 1,792 GB/s.
        assert!(close(derived.fp32_tflops, 125.95, 0.001), "{derived:?}");
        assert!(
            close(derived.memory_bandwidth_gb_s, 1792.1, 0.001),
            "{derived:?}"
        );
        assert_eq!(derived.max_warps_per_sm, 48);
        let no_bus = FakeDevices::single("NVIDIA Mystery", 8_000).with_hardware(
            Some("8.6"),
            Some(10),
            Some(1500),
            Some(7000),
            None,
        );
        assert_eq!(performance_of(&no_bus.attached().unwrap()), None);
        let odd_arch = FakeDevices::single("NVIDIA Mystery", 8_000).with_hardware(
            Some("6.1"),
            Some(10),
            Some(1500),
            Some(7000),
            Some(128),
        );
        assert_eq!(performance_of(&odd_arch.attached().unwrap()), None);
    }

    #[test]
    fn sms_follow_from_cores() {
        assert_eq!(sm_count_from_cores("8.0", 6912), Some(108));
        assert_eq!(sm_count_from_cores("8.9", 16384), Some(128));
        assert_eq!(sm_count_from_cores("8.9", 100), None);
        assert_eq!(sm_count_from_cores("5.2", 2048), None);
    }
}
