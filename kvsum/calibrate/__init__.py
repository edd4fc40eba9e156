"""Calibration for the reconstruction methods (`echokv`, `lowrank`): one plain pass over text, closed-form fits.

`calibrate` runs the model over calibration text (kvsum.calibrate.text: a slice of the stdlib's source by
default) and accumulates, per layer, the first and second moments of its keys and values and their
cross-covariance with the previous layer (kvsum.calibrate.stats). These moments are sufficient statistics for
every fit the methods need, so one `Artifact` serves every budget, keep fraction and rank
(kvsum.calibrate.fit):
- `lowrank` bases are the eigenvectors of a layer's covariance (PCA), or of two adjacent layers' joint
  covariance for `share_layers=2` (sorted: any rank is a slice);
- `echokv` chooses which channels to store greedily (the channel that explains the most remaining variance of
  the others, given the previous layer's stored channels) and rebuilds the others by ridge regression from
  the stored channels of this layer and the previous one.
The fits run on first use and are memoized on the Artifact.

RoPE: keys are cached after the rotation, which turns a fixed linear relation between channels into a
position-dependent one. Keys are un-rotated (kvsum.rope) and fitted before RoPE ("k_pre"); the methods rotate
what they rebuild back at attention time. Post-RoPE key moments ("k_post") are kept too, for lowrank's
space="post" (scoring in the reduced space without rebuilding keys) and for models whose rotary embedding
cannot be inverted.

Artifacts are checked against the model by its fingerprint (kvsum.shape.fingerprint) and found by it:
`kvsum calibrate --model M` saves to `default_artifact_path`, where `artifact=None` looks (kvsum.calibrate.store).
"""

from ..shape import fingerprint
from .artifact import FORMAT, Artifact, describe
from .fit import RIDGE, EchoPlan, greedy_channels
from .stats import DEFAULT_TOKENS, SEQ_LEN, SKIP, calibrate
from .store import METHODS, artifact_for, default_artifact_path, find_artifact, load_cached, resolve
from .text import MODULE_CHARS, calibration_text, stdlib_modules

__all__ = ["DEFAULT_TOKENS", "FORMAT", "METHODS", "MODULE_CHARS", "RIDGE", "SEQ_LEN", "SKIP", "Artifact", "EchoPlan",
           "artifact_for", "calibrate", "calibration_text", "default_artifact_path", "describe", "find_artifact",
           "fingerprint", "greedy_channels", "load_cached", "resolve", "stdlib_modules"]
