//! The walks every surgery algorithm makes over a [`Surgical`] model, one per kind of layer,
//! written once here rather than in every model: each visits the model's layers and acts on
//! those of its kind, in the order the model shows them. The seeds of the surgeries that
//! draw new weights are derived here too, from the layer's position among those of its kind,
//! so that every rank of a data-parallel run builds the same layers.

use flashover_core::rng::derive_seed;

use crate::settings::{
    AttentionInfo, AttentionVariant, ConvInfo, ConvVariant, DropoutInfo, DropoutVariant,
    GluSettings, GroupNormVariant, LayerNormVariant, LinearInfo, MlpInfo, NormInfo, NormVariant,
    PoolInfo, PoolVariant, ResidualInfo, ResidualVariant,
};
use crate::{LayerKind, LayerMut, Layers, Surgical};

/// The walks over a [`Surgical`] model's layers, for every such model (also `dyn Surgical`).
pub trait SurgicalExt: Surgical {
    /// Calls `f` on every layer the model shows, with its path.
    fn visit(&mut self, f: &mut dyn FnMut(&str, LayerMut<'_>)) {
        self.visit_layers(&mut Layers::new(f));
    }

    /// Whether the model shows at least one layer of `kind`.
    fn has(&mut self, kind: LayerKind) -> bool {
        let mut found = false;
        self.visit(&mut |_, layer| found |= layer.kind() == kind);
        found
    }

    /// Calls `f` on every convolution.
    fn for_each_conv(&mut self, f: &mut dyn FnMut(&ConvInfo, &mut ConvVariant)) {
        self.visit(&mut |path, layer| {
            if let LayerMut::Conv(c) = layer {
                f(&c.info(path), c.variant());
            }
        });
    }

    /// Calls `f` on every max pool.
    fn for_each_max_pool(&mut self, f: &mut dyn FnMut(&PoolInfo, &mut PoolVariant)) {
        self.visit(&mut |path, layer| {
            if let LayerMut::MaxPool(p) = layer {
                f(&p.info(path), p.variant());
            }
        });
    }

    /// Calls `f` on every batch norm.
    fn for_each_batch_norm(&mut self, f: &mut dyn FnMut(&NormInfo, &mut NormVariant)) {
        self.visit(&mut |path, layer| {
            if let LayerMut::BatchNorm(n) = layer {
                f(&n.info(path), n.variant());
            }
        });
    }

    /// Calls `f` on every group norm.
    fn for_each_group_norm(&mut self, f: &mut dyn FnMut(&NormInfo, &mut GroupNormVariant)) {
        self.visit(&mut |path, layer| {
            if let LayerMut::GroupNorm(n) = layer {
                f(&n.info(path), n.variant());
            }
        });
    }

    /// Calls `f` on every layer norm.
    fn for_each_layer_norm(&mut self, f: &mut dyn FnMut(&NormInfo, &mut LayerNormVariant)) {
        self.visit(&mut |path, layer| {
            if let LayerMut::LayerNorm(n) = layer {
                f(&n.info(path), n.variant());
            }
        });
    }

    /// Calls `f` on every residual block, with its position among them and their count.
    fn for_each_residual(&mut self, f: &mut dyn FnMut(&ResidualInfo, &mut ResidualVariant)) {
        let mut count = 0;
        self.visit(&mut |_, layer| count += usize::from(layer.kind() == LayerKind::Residual));
        let mut index = 0;
        self.visit(&mut |path, layer| {
            if let LayerMut::Residual(b) = layer {
                let info = ResidualInfo {
                    path: path.to_string(),
                    index,
                    count,
                };
                index += 1;
                f(&info, b.variant());
            }
        });
    }

    /// Calls `f` on every dropout site.
    fn for_each_dropout(&mut self, f: &mut dyn FnMut(&DropoutInfo, &mut DropoutVariant)) {
        self.visit(&mut |path, layer| {
            if let LayerMut::DropoutSite(s) = layer {
                let info = DropoutInfo {
                    path: path.to_string(),
                    features: s.features(),
                };
                f(&info, s.dropout());
            }
        });
    }

    /// Calls `f` on every attention layer.
    fn for_each_attention(&mut self, f: &mut dyn FnMut(&AttentionInfo, &mut AttentionVariant)) {
        self.visit(&mut |path, layer| {
            if let LayerMut::Attention(a) = layer {
                f(&a.info(path), a.variant());
            }
        });
    }

    /// Removes the model's learned position embeddings and lets it take inputs of up to
    /// `max_sequence_length` tokens. Returns the path of those removed, or `None` if the
    /// model had none.
    fn remove_position_embeddings(&mut self, max_sequence_length: usize) -> Option<String> {
        let mut removed = None;
        self.visit(&mut |path, layer| {
            if let LayerMut::PositionEmbeddings(p) = layer {
                if p.remove(max_sequence_length) && removed.is_none() {
                    removed = Some(path.to_string());
                }
            }
        });
        removed
    }

    /// Rebuilds every MLP for which `settings` returns settings as a gated linear unit
    /// ([`MlpLayer::make_gated`](crate::MlpLayer::make_gated)), seeded by
    /// `derive_seed(&[seed, index])` (`index` counting the MLPs from 0). An MLP already
    /// gated keeps its layers. Returns the paths of the MLPs rebuilt.
    fn gated_linear_units(
        &mut self,
        settings: &mut dyn FnMut(&MlpInfo) -> Option<GluSettings>,
        seed: u64,
    ) -> Vec<String> {
        let mut done = Vec::new();
        let mut index = 0u64;
        self.visit(&mut |path, layer| {
            if let LayerMut::Mlp(m) = layer {
                let i = index;
                index += 1;
                if m.is_gated() {
                    return;
                }
                if let Some(s) = settings(&m.info(path)) {
                    m.make_gated(&s, derive_seed(&[seed, i]));
                    done.push(path.to_string());
                }
            }
        });
        done
    }

    /// Adds a squeeze-and-excitation block after every convolution for which `latent`
    /// returns a hidden width, drawn from a generator seeded by `derive_seed(&[seed,
    /// index])` (`index` counting the convolutions from 0). A convolution that already has a
    /// block keeps it. Returns the paths of the convolutions given a block.
    fn add_squeeze_excite(
        &mut self,
        latent: &mut dyn FnMut(&ConvInfo) -> Option<usize>,
        seed: u64,
    ) -> Vec<String> {
        let mut added = Vec::new();
        let mut index = 0u64;
        self.visit(&mut |path, layer| {
            if let LayerMut::Conv(c) = layer {
                let i = index;
                index += 1;
                if c.has_squeeze_excite() {
                    return;
                }
                if let Some(hidden) = latent(&c.info(path)) {
                    c.add_squeeze_excite(hidden, derive_seed(&[seed, i]));
                    added.push(path.to_string());
                }
            }
        });
        added
    }

    /// Factors every convolution for which `conv_rank` returns a rank, then every dense
    /// layer for which `linear_rank` does ([`ConvLayer::factorize`](crate::ConvLayer::factorize)).
    /// Layers already factored, and grouped convolutions, are not offered. Returns the
    /// paths of the layers factored, convolutions first.
    fn factorize(
        &mut self,
        conv_rank: &mut dyn FnMut(&ConvInfo) -> Option<usize>,
        linear_rank: &mut dyn FnMut(&LinearInfo) -> Option<usize>,
    ) -> Vec<String> {
        let mut factored = Vec::new();
        self.visit(&mut |path, layer| {
            if let LayerMut::Conv(c) = layer {
                let info = c.info(path);
                if c.is_factored() || info.groups != 1 {
                    return;
                }
                if let Some(rank) = conv_rank(&info) {
                    c.factorize(rank);
                    factored.push(path.to_string());
                }
            }
        });
        self.visit(&mut |path, layer| {
            if let LayerMut::Linear(l) = layer {
                if l.is_factored() {
                    return;
                }
                if let Some(rank) = linear_rank(&l.info(path)) {
                    l.factorize(rank);
                    factored.push(path.to_string());
                }
            }
        });
        factored
    }
}

impl<M: Surgical + ?Sized> SurgicalExt for M {}
