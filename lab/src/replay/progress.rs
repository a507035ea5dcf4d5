//! The progress bar of a mode's run: requests done, errors and the running hit rate. Hidden
//! when stderr is not a terminal, and in `--quiet` / `--json` runs.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::driver::Tally;

/// One mode's bar.
#[derive(Debug)]
pub struct Progress {
    bar: ProgressBar,
}

impl Progress {
    pub fn new(mode: &str, total: u64, visible: bool) -> Self {
        let bar = ProgressBar::with_draw_target(
            Some(total),
            if visible {
                ProgressDrawTarget::stderr()
            } else {
                ProgressDrawTarget::hidden()
            },
        );
        bar.set_style(
            ProgressStyle::with_template(
                "{prefix:>12} [{elapsed_precise}] {wide_bar} {pos}/{len} {msg}",
            )
            .expect("a valid template"),
        );
        bar.set_prefix(mode.to_owned());
        Self { bar }
    }

    pub fn update(&self, t: &Tally) {
        self.bar.set_position(t.done + t.errors);
        self.bar.set_message(format!(
            "errors {} · hit rate {:.1}%",
            t.errors,
            t.hit_rate() * 100.0
        ));
    }

    pub fn finish(&self) {
        self.bar.finish();
    }
}
