"""The docstring fragments that the optimizer classes of :mod:`dpkern.optim` share.

The privacy arguments (``_DP_ARGS``), ``update_rms_clip`` (``_RMS_CLIP_ARG``), the Adam
family's math and arguments (``_ADAM_MATH``, ``_ADAM_ARGS``, ``_BC_MATH``) and the
schedule-free classes' (``_SF_MATH``, ``_SF_ARGS``, ``_SF_NOTES``). Text only, no code.
"""

_DP_ARGS = r"""
    Privacy arguments (keyword-only):
        max_grad_norm (float): C > 0, the L2 bound on each sample's gradient over ALL
            parameters (flat clipping, c_i = min(1, C / (||g_i|| + 1e-6)), SPEC 2).
        noise_multiplier (float): sigma >= 0; the noise on the clipped sum has standard
            deviation sigma * C. Get it from :func:`dpkern.accounting.get_noise_multiplier`.
        expected_batch_size (float): B_e > 0, the normaliser: sample_rate * dataset size
            under Poisson sampling (the real batch may be 0 or larger).
        seed (int or None): None (default) = private: the noise key comes from os.urandom
            and never leaves the process (not in state_dict, repr, pickle or logs). An int
            in [0, 2**64) IS the noise key: the run is reproducible and NOT private (anyone
            with the seed and the weights subtracts the noise exactly); it is saved in
            state_dict. Seed initialisation and sampling elsewhere, not here.
        backend (str): "auto" (triton for CUDA, cpp for CPU if built, else torch), "torch"
            (the reference), "triton" or "cpp".
        nonfinite (str): "error" (default): a sample with a NaN/Inf gradient raises
            FloatingPointError and nothing is updated; "zero": such samples are dropped
            (their rows contribute nothing) and counted in ``stats``.
        stochastic_rounding (bool): False (default): bfloat16 parameters are rounded to
            nearest even on store; True: stochastically, E[round(x)] = x, so updates
            smaller than a bf16 ulp are kept on average (SPEC 3.2: Philox stream 2 of the
            noise key). float32 and float16 parameters are unaffected.

    Input: ``step()`` reads ``p.grad_sample`` (``[B, *p.shape]``, any float dtype, from
    ``opacus.GradSampleModule`` or :func:`dpkern.grad_sample.compute_grad_sample`), never
    ``p.grad``, and consumes it (a second step over the same samples raises); or the
    clipped sums given to ``accumulate_clipped`` (ghost clipping). Parameters: float32,
    bfloat16 or float16 (updated in fp32, rounded once); states: float32.

    Raises: ValueError for invalid hyper-parameters (at construction, naming the value)
    and for bad, stale or missing per-sample gradients at ``step()``; FloatingPointError
    (non-finite gradients, nonfinite="error"). A failed step changes nothing.
    ``stats`` holds exact counts in memory only (never in state_dict). "SPEC n" is a
    section of the contract, docs/SPEC.md (``python -m dpkern.spec`` prints it).
"""

_RMS_CLIP_ARG = r"""        update_rms_clip (float or None, keyword-only): d_u > 0, finite: the update
            direction U of every parameter (all param groups together) is scaled by
            1 / max(1, RMS / d_u), RMS = sqrt(sum of U^2 over all N elements / N) in
            float64, so the update's RMS over the whole model is at most d_u; weight
            decay is not scaled. None (default): off. Every param group must hold the same
            value (ValueError at step()). Post-processing of the noisy gradient: the DP
            guarantee is unchanged. Source: the global variant of StableAdamW's per-tensor
            update clipping (Wortsman et al. 2023, arXiv 2304.13013, Algorithm 2) and of
            Adafactor's (Shazeer & Stern 2018, Section 6); SPEC 10.9.
"""

_ADAM_MATH = r"""
    .. math::
        \begin{aligned}
        &\hat g = \big(\textstyle\sum_i c_i g_i + \sigma C z_t\big) / B_e
          \quad (c_i = \min(1, C / (\lVert g_i \rVert + 10^{-6}))) \\
        &m \leftarrow \beta_1 m + (1-\beta_1) g, \quad v \leftarrow \beta_2 v + (1-\beta_2) g^2,
          \quad \hat m = m / (1-\beta_1^t), \quad \hat v = v / (1-\beta_2^t)
        \end{aligned}

    with t the parameter's own step count (``state["step"]``, as torch.optim).
"""

_ADAM_ARGS = r"""
    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr (float): learning rate gamma (default 1e-3).
        betas (tuple[float, float]): (beta1, beta2) in [0, 1) (default (0.9, 0.999)).
"""

_BC_MATH = r"""
    and the denominator :math:`\sqrt{\max(\hat v - \hat\varphi, \gamma_0)}` where
    :math:`\varphi \leftarrow \beta_2 \varphi + (1-\beta_2)\Phi_t`,
    :math:`\Phi_t = (\sigma C / B_e)^2` (the noise variance in each coordinate of
    :math:`\hat g`) and :math:`\hat\varphi = \varphi / (1 - \beta_2^t)`.
"""

_SF_MATH = r"""
    .. math::
        \begin{aligned}
        &\gamma_t = \gamma \min(1, t / T_w), \quad \gamma^{\max}_t = \max(\gamma_t,
          \gamma^{\max}_{t-1}), \quad w_t = t^r (\gamma^{\max}_t)^{p_w}, \quad
          c_t = w_t / \textstyle\sum_{s \le t} w_s \\
        &y \leftarrow (1 - c_t)\, y + c_t z + \gamma_t (\beta (1 - c_t) - 1)\, u, \qquad
          z \leftarrow z - \gamma_t u
        \end{aligned}

    where the parameters hold y in train mode (gradients are taken at y), z is the base
    sequence (z = y at the parameter's first step) and x = (y - (1 - beta) z) / beta the
    average that is evaluated: ``eval()`` sets the parameters to x, ``train()`` back to y
    (element-wise, no noise and no privacy cost). t counts the group's steps; the
    per-group scalars ``k`` (steps), ``weight_sum``, ``lr_max``, ``train_mode`` and
    ``scheduled_lr`` live in the param group, as in ``schedulefree``, so ``state_dict()``
    round-trips them.
"""

_SF_ARGS = r"""        weight_decay (float): lambda >= 0, evaluated at y (default 0).
        warmup_steps (int): T_w >= 0, linear learning-rate warmup (default 0).
        r (float): r >= 0, polynomial weighting of the average (default 0).
        weight_lr_power (float): p_w >= 0, the average's weights grow with lr_max^p_w
            (default 2).
"""

_SF_NOTES = r"""
    Modes: like ``schedulefree``, the optimizer starts in eval mode: call ``train()``
    before the first step (and after every ``eval()``), and ``eval()`` before evaluating
    or saving the model. ``step()`` / ``accumulate()`` in eval mode raise RuntimeError
    (nothing consumed or changed).

    Every trainable parameter of a group is updated at every step (DP noises them all), so
    a parameter's own step equals its group's ``k + 1``; a parameter that joins a group
    later (unfrozen after the group's first step) is refused with ValueError: put it in a
    new param group (``add_param_group``: its own averaging from step 1). A group whose
    parameters are all frozen does not advance. Data parallelism (DDP, lockstep) works as
    for every rule; FSDP2 works (every state is shaped like the parameter, or a scalar),
    ``train()`` / ``eval()`` act on each rank's shard.
"""
