"""Thompson sampling with a Beta-Bernoulli or a Normal model of each arm's mean reward."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from typing import Literal

from pydantic import Field

from metasd.core.decoding.policy import Float, PolicyParams, register_policy

from ._common import BasePolicy, Context, first_unplayed


class ThompsonParams(PolicyParams):
    """Hyper-parameters of Thompson sampling (see the class docstring)."""

    likelihood: Literal["bernoulli", "gaussian"] = Field("bernoulli", description="reward model")
    prior_alpha: Float = Field(1.0, gt=0.0, allow_inf_nan=False, description="bernoulli: Beta prior alpha")
    prior_beta: Float = Field(1.0, gt=0.0, allow_inf_nan=False, description="bernoulli: Beta prior beta")
    prior_mean: Float = Field(0.0, allow_inf_nan=False, description="gaussian: prior mean of each arm's mean")
    prior_std: Float | None = Field(None, gt=0.0, allow_inf_nan=False, description="gaussian: prior std (None: flat)")
    noise_std: Float | None = Field(None, gt=0.0, allow_inf_nan=False,
                                    description="gaussian: reward noise std (None: estimated)")


@register_policy
class ThompsonSampling(BasePolicy):
    """Thompson sampling (Thompson 1933; Agrawal & Goyal 2012): sample a mean for every arm from its
    posterior and play the argmax. Randomised, so it explores without a tuned bonus.

    ``likelihood="bernoulli"`` (default; rewards in [0, 1] such as block efficiency ``n_acc / k`` or
    block divergence): Beta(``prior_alpha``, ``prior_beta``) prior, Beta(1, 1) by default. A reward
    ``r`` is turned into a Bernoulli trial that succeeds with probability ``r`` (Agrawal & Goyal's
    binarisation), so the posterior stays Beta; a reward outside [0, 1] raises ``ValueError``.

    ``likelihood="gaussian"`` (unbounded rewards such as tokens/s): each arm's reward is modelled as
    Normal(mu_i, sigma_i^2). Prior on mu_i: Normal(``prior_mean``, ``prior_std``^2), or flat when
    ``prior_std`` is None (the default; every arm is then played once first). ``noise_std`` fixes
    sigma_i; when None (default) sigma_i^2 is estimated as ``(M2_i + v) / n_i`` (``M2_i`` the arm's sum of
    squared deviations, ``n_i`` its plays), i.e. the arm's sample variance shrunk by one pseudo-observation
    towards ``v`` = the pooled within-arm variance (itself shrunk towards the variance of all rewards).
    The posterior of mu_i is then Normal with precision ``1/prior_std^2 + n_i/sigma_i^2``.

    All sampling goes through ``self.rng`` (its state is part of ``state_dict``).
    """

    name = "thompson"
    Params = ThompsonParams

    @property
    def requires_bounded_rewards(self) -> bool:
        return self.likelihood == "bernoulli"

    def reset(self) -> None:
        # Bernoulli model: Beta posterior parameters.
        self.alpha = np.full(self.n_arms, self.prior_alpha, dtype=np.float64)
        self.beta = np.full(self.n_arms, self.prior_beta, dtype=np.float64)
        # Gaussian model: per-arm Welford statistics plus the same over all rewards.
        self.counts = np.zeros(self.n_arms, dtype=np.int64)
        self.means = np.zeros(self.n_arms, dtype=np.float64)
        self.m2 = np.zeros(self.n_arms, dtype=np.float64)
        self.g_n = 0
        self.g_mean = 0.0
        self.g_m2 = 0.0

    # -- selection ---------------------------------------------------------------------------------
    def select(self, context: Context = None) -> int:
        if self.likelihood == "bernoulli":
            return int(np.argmax(self.rng.beta(self.alpha, self.beta)))
        return self._select_gaussian()

    def _noise_var(self) -> np.ndarray | float:
        if self.noise_std is not None:
            return self.noise_std ** 2
        g_var = self.g_m2 / self.g_n if self.g_n >= 2 else 0.0
        dof = int(np.maximum(self.counts - 1, 0).sum())
        pooled = (float(self.m2.sum()) + g_var) / (dof + 1)
        return (self.m2 + pooled) / np.maximum(self.counts, 1)

    def _select_gaussian(self) -> int:
        if self.prior_std is None:
            arm = first_unplayed(self.counts)
            if arm >= 0:
                return arm
        var = self._noise_var()
        # precision of each arm's posterior on its mean; var == 0 only when every reward so far is identical
        with np.errstate(divide="ignore", invalid="ignore"):
            data_precision = np.where(self.counts > 0, self.counts / np.maximum(var, 1e-300), 0.0)
        if self.prior_std is None:
            precision = data_precision
            post_mean = self.means
        else:
            prior_precision = 1.0 / self.prior_std ** 2
            precision = prior_precision + data_precision
            post_mean = (prior_precision * self.prior_mean + data_precision * self.means) / precision
        samples = post_mean + self.rng.standard_normal(self.n_arms) / np.sqrt(precision)
        return int(np.argmax(samples))

    # -- update ------------------------------------------------------------------------------------
    uses_counterfactuals = True
    forced_arms_unbiased = True  # per-arm estimates from the rewards alone

    def observe(self, arm: int, rewards: Mapping[int, float], context: Context = None) -> None:
        """Full information: every scored arm's posterior takes its sample (arms in index order, so the random stream
        is the same whatever order the rewards came in)."""
        self._check_arm(arm)
        if arm not in rewards:
            raise ValueError(f"{self._label()}: the chosen arm {arm} has no reward among {sorted(rewards)}")
        for a, r in sorted(rewards.items()):
            self.update(a, r, context)

    def update(self, arm: int, reward: float, context: Context = None) -> None:
        arm = self._check_arm(arm)
        if self.likelihood == "bernoulli":
            reward = self._check_unit_reward(reward)
            if self.rng.random() < reward:
                self.alpha[arm] += 1.0
            else:
                self.beta[arm] += 1.0
            return
        reward = self._check_reward(reward)
        self.counts[arm] += 1
        delta = reward - self.means[arm]
        self.means[arm] += delta / self.counts[arm]
        self.m2[arm] += delta * (reward - self.means[arm])
        self.g_n += 1
        g_delta = reward - self.g_mean
        self.g_mean += g_delta / self.g_n
        self.g_m2 += g_delta * (reward - self.g_mean)

    # -- state -------------------------------------------------------------------------------------
    def _state_items(self) -> dict[str, Any]:
        return {
            "alpha": self.alpha, "beta": self.beta,
            "counts": self.counts, "means": self.means, "m2": self.m2,
            "g_n": self.g_n, "g_mean": self.g_mean, "g_m2": self.g_m2,
            "rng_state": self.rng_state,
        }

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "likelihood": self.likelihood}
        if self.likelihood == "bernoulli":
            out.update(prior_alpha=self.prior_alpha, prior_beta=self.prior_beta)
        else:
            out.update(prior_mean=self.prior_mean, prior_std=self.prior_std, noise_std=self.noise_std)
        return out


__all__ = ["ThompsonSampling"]
