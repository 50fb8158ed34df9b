//! When a new reading is worth telling the aggregator. A real GPU's power,
//! read in milliwatts, changes on nearly every sample, and its temperature drifts by a
//! degree: announcing each as a new generation made every node stream a document a
//! second. A reading is announced at once when anything but temperature and power
//! changed (a counter, the link, a status the vendor reports, the classification),
//! when temperature moved by `temperature_c` or power by `power_share` of itself (at
//! least a watt); the drift below that is announced by the store's upkeep at most every
//! `refresh`. `/v1/health` and the metrics always show the latest reading.

use std::time::Duration;

use faultline_common::{classify, DeviceReading, Thresholds};

/// How far temperature and power move before a new reading is announced.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Deadband {
    /// Degrees Celsius.
    pub temperature_c: f64,
    /// A share (0-1) of the last announced power.
    pub power_share: f64,
    /// Drift within the band is announced at most this often.
    pub refresh: Duration,
}

impl Default for Deadband {
    fn default() -> Self {
        Deadband {
            temperature_c: 2.0,
            power_share: 0.1,
            refresh: Duration::from_secs(60),
        }
    }
}

/// The smallest power change ever announced, in watts (an idle device's noise).
const MIN_POWER_STEP_W: f64 = 1.0;

impl Deadband {
    /// Whether `now` differs from `announced` by more than the band, or in anything
    /// other than temperature and power, or in how `thresholds` classify it.
    pub fn moved(&self, announced: &DeviceReading, now: &DeviceReading, t: &Thresholds) -> bool {
        if announced == now {
            return false;
        }
        let past = |a: Option<f64>, b: Option<f64>, step: f64| match (a, b) {
            (Some(a), Some(b)) => (a - b).abs() >= step,
            (None, None) => false,
            _ => true,
        };
        let power_step = announced.power_w.map_or(MIN_POWER_STEP_W, |p| {
            (p.abs() * self.power_share).max(MIN_POWER_STEP_W)
        });
        if past(
            announced.temperature_c,
            now.temperature_c,
            self.temperature_c,
        ) || past(announced.power_w, now.power_w, power_step)
        {
            return true;
        }
        let mut same = announced.clone();
        same.temperature_c = now.temperature_c;
        same.power_w = now.power_w;
        if same != *now {
            return true;
        }
        // Within the band, but across a threshold: a new status is news.
        let (a, b) = (classify(announced, None, t), classify(now, None, t));
        a.status != b.status || a.reason != b.reason
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use faultline_common::Vendor;

    fn gpu(temp: f64, power: f64) -> DeviceReading {
        let mut r = DeviceReading::new("gpu0", Vendor::Nvidia, "nvml");
        r.temperature_c = Some(temp);
        r.power_w = Some(power);
        r
    }

    #[test]
    fn noise_within_the_band_is_not_news_and_a_step_past_it_is() {
        let d = Deadband::default();
        let t = Thresholds::default();
        let base = gpu(60.0, 400.0);
        for (temp, power, moved) in [
            (60.0, 400.0, false),
            (61.9, 400.0, false),
            (58.1, 430.0, false),
            (60.0, 360.1, false),
            (62.0, 400.0, true),
            (57.9, 400.0, true),
            (60.0, 440.0, true),
            (60.0, 359.0, true),
        ] {
            assert_eq!(
                d.moved(&base, &gpu(temp, power), &t),
                moved,
                "{temp} C, {power} W"
            );
        }
        // An idle device: a watt at least.
        assert!(!d.moved(&gpu(40.0, 0.2), &gpu(40.0, 0.9), &t));
        assert!(d.moved(&gpu(40.0, 0.2), &gpu(40.0, 1.3), &t));
        // A reading that appears or goes away is news.
        let mut none = base.clone();
        none.power_w = None;
        assert!(d.moved(&base, &none, &t));
    }

    #[test]
    fn anything_else_is_news_at_once() {
        let d = Deadband::default();
        let t = Thresholds::default();
        let base = gpu(60.0, 400.0);
        let mut lost = gpu(60.5, 401.0);
        lost.lost = true;
        assert!(d.moved(&base, &lost, &t));
        let mut other = gpu(60.5, 401.0);
        other.uuid = Some("GPU-1".into());
        assert!(d.moved(&base, &other, &t));
    }

    #[test]
    fn a_threshold_crossed_within_the_band_is_news() {
        let d = Deadband::default();
        let t = Thresholds::default();
        let hot = t.temp_degraded_c;
        let below = gpu(hot - 0.5, 400.0);
        let above = gpu(hot + 0.5, 400.0);
        assert!(d.moved(&below, &above, &t), "crossed {hot} C by a degree");
    }
}
