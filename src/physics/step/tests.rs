use super::*;
use crate::job::setup::{UncheckedOffload, UncheckedParallelism, UncheckedSetup, UncheckedZero};
use crate::job::validated::UncheckedLayer;

/// Ten linear layers of 1e8 parameters each, fp32, on one GPU under ZeRO-3 with `offload`.
fn zero3_job(offload: UncheckedOffload, zero: Option<UncheckedZero>) -> Job {
    let layers = (0..10).map(|_| UncheckedLayer {
        kind: "linear",
        output_size: 1024,
        params: 100_000_000,
    });
    Job::parse(None, 8, layers)
        .unwrap()
        .with_setup(&UncheckedSetup {
            parallelism: Some(UncheckedParallelism {
                strategy: Some("zero3"),
                world_size: Some(1),
                ..Default::default()
            }),
            offload: Some(offload),
            zero,
            ..Default::default()
        })
        .unwrap()
}

#[test]
fn zero3_keeps_gathered_what_its_reuse_distance_and_prefetch_bucket_say() {
    let parameters = UncheckedOffload {
        parameters: Some(true),
        ..Default::default()
    };
    // DeepSpeed's defaults: the last six layers lie within 1e9 of their reuse (twice the
    // parameters after them), 5e7 more prefetched; the 5e8-element bucket beside them.
    let defaults = analytic_step(&zero3_job(parameters, None));
    assert_eq!(defaults.layout_buffers, (6.5e8 + 5e8) * 4.0);
    // No reuse, no prefetch, a small bucket: the running layer and the bucket alone.
    let tight = analytic_step(&zero3_job(
        parameters,
        Some(UncheckedZero {
            reduce_bucket_size: Some(1_000),
            prefetch_bucket_size: Some(0),
            max_reuse_distance: Some(0),
            ..Default::default()
        }),
    ));
    assert_eq!(tight.layout_buffers, (1e8 + 1e3) * 4.0);
    assert_eq!(tight.parameters, 0.0);
}

#[test]
fn zero3_with_the_optimizer_offloaded_keeps_its_gradients_on_the_cpu() {
    let on_gpu = analytic_step(&zero3_job(UncheckedOffload::default(), None));
    let offloaded = analytic_step(&zero3_job(
        UncheckedOffload {
            optimizer_state: Some(true),
            ..Default::default()
        },
        None,
    ));
    // One layer's gradient as autograd makes it, not the partition of all ten.
    let at_step = |m: &StepMemory| {
        if m.at_optimizer_step {
            m.gradients
        } else {
            m.other_moment.gradients
        }
    };
    assert_eq!(at_step(&on_gpu), 1e9 * 4.0);
    assert!(at_step(&offloaded) <= 1e8 * 4.0);
    assert_eq!(offloaded.optimizer_state, 0.0);
    // The reduce bucket is there on one GPU too.
    assert_eq!(offloaded.layout_buffers, 5e8 * 4.0);
}

#[test]
fn zero3_steps_one_sub_group_of_fp32_gradients_at_a_time() {
    let step = |sub_group_size| {
        analytic_step(&zero3_job(
            UncheckedOffload::default(),
            Some(UncheckedZero {
                sub_group_size: Some(sub_group_size),
                ..Default::default()
            }),
        ))
    };
    let whole = step(1_000_000_000_000);
    let small = step(1_000);
    let temporaries = |m: &StepMemory| {
        if m.at_optimizer_step {
            m.temporaries
        } else {
            m.other_moment.temporaries
        }
    };
    assert_eq!(temporaries(&whole) - temporaries(&small), (1e9 - 1e3) * 4.0);
}
