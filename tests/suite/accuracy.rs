//! The main job's promise: the example's default recipe reaches 97% test accuracy on the
//! bundled digits.

use crate::support::*;
use flashover_examples::MnistRun;

#[test]
fn default_recipe_reaches_97_percent_on_bundled_mnist() {
    let t = trained(&MnistRun::default());
    let acc = t.state().eval_metrics()["test"]["accuracy"];
    assert!(acc >= 0.97, "test accuracy {acc} with the default recipe");
}
