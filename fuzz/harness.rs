//! What each fuzz target does with its input, shared by the libFuzzer targets
//! (`fuzz_targets/*.rs`) and the regression test that replays saved crashes
//! (`tests/fuzz_regressions.rs`), so a crash reproduces exactly the same way in both.
//! Each function must never panic, whatever the bytes.

use gpucast::domain::summary::{parse_summary, SummaryFormat};
use gpucast::http::types::EstimateRequest;

/// The JSON description path of `POST /v1/estimate`: bytes -> wire type -> validated job
/// (a layer list, or summary text parsed into one).
pub fn estimate_request(data: &[u8]) {
    if let Ok(request) = serde_json::from_slice::<EstimateRequest>(data) {
        let _ = gpucast::http::validate::to_job(&request);
    }
}

/// Summary text parsing. The first byte selects the format (bit 0: torchsummary/torchinfo table
/// or module print), whether `seq_len` is given (bit 1) and its value (bits 2-7, times 8, plus 1);
/// the rest is the text, which must be UTF-8 as it is in a JSON string.
pub fn summary(data: &[u8]) {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let format = if selector & 1 == 0 {
        SummaryFormat::Torchsummary
    } else {
        SummaryFormat::ModulePrint
    };
    let seq_len = (selector & 2 != 0).then(|| u64::from(selector >> 2) * 8 + 1);
    let _ = parse_summary(format, text, 32, seq_len);
}
