"""Messages kept word for word as Horovod 0.28.1 words them.

User code and log scrapers match on these (``except ValueError as e: if "..." in str(e)``,
alerts on the stall warning), so a drop-in replacement must say exactly the same thing.
They are the only text this project takes over from Horovod, and they all live here; every
other message is our own.  ``tools/provenance_check.py`` exempts this file and nothing else.

Placeholders use ``str.format`` fields.
"""

# ---- runtime ----------------------------------------------------------------------------
NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."

SHUT_DOWN = (
    "Horovod has been shut down. This was caused by an exception on one of the ranks or an "
    "attempt to allreduce, allgather or broadcast a tensor after one of the ranks finished "
    "execution. If the shutdown was caused by an exception, you should see the exception in "
    "the log before the first shutdown message.")

DUPLICATE_NAME = (
    "Requested to allreduce, allgather, or broadcast a tensor with the same name as another "
    "tensor that is currently being processed.  If you want to request another tensor, use a "
    "different tensor name.")

STALL_WARNING = (
    "One or more tensors were submitted to be reduced, gathered or broadcasted by subset of "
    "ranks and are waiting for remainder of ranks for more than {seconds} seconds. This may "
    "indicate that different ranks are trying to submit different tensors or that only subset "
    "of ranks is submitting tensors, which will cause deadlock. \nMissing ranks:")

STALL_SHUTDOWN_BELOW_WARNING = (
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS is less than HOROVOD_STALL_CHECK_TIME_SECONDS, will "
    "not shutdown.")

TIMELINE_NOT_DYNAMIC = "Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic timeline usage."

# ---- process sets ------------------------------------------------------------------------
ADD_PROCESS_SET_DISABLED = ("Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow adding process sets "
                            "after Horovod initialization.")
REMOVE_PROCESS_SET_DISABLED = ("Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow removing process "
                               "sets after Horovod initialization.")
NOT_IN_PROCESS_SET = "Process is not part of provided process set."
UNKNOWN_PROCESS_SET = "Process set does not exist or has not been registered."

# ---- collectives -------------------------------------------------------------------------
TENSOR_TYPE_NOT_SUPPORTED = "Tensor type {} is not supported."
OP_SUPERSEDES_AVERAGE = "The op parameter supersedes average. Please provide only one of them."
AVERAGE_DEPRECATED = ("Parameter `average` has been replaced with `op` and will be removed in "
                      "v1.0")
ADASUM_PROCESS_SETS = "Adasum does not support non-global process sets yet."
ADASUM_NON_POWER_OF_2 = "Running Adasum with non-power of 2 ranks is not supported yet."

# ---- DistributedOptimizer and helpers (PyTorch) ------------------------------------------
NAMED_PARAMETERS_NOT_TUPLES = ("named_parameters should be a sequence of tuples (name, "
                               "parameter), usually produced by model.named_parameters().")
NAMED_PARAMETERS_DUPLICATES = ("Parameter names in named_parameters must be unique. Found "
                               "duplicates: {}")
NAMED_PARAMETERS_INCOMPLETE = ("named_parameters was specified, but one or more model "
                               "parameters were not named. Python object ids: {}")
GROUPS_TYPE = "groups should be a non-negative integer or a list of list of torch.Tensor."
GROUPS_NOT_TENSORS = "groups must consist of torch.Tensor."
GROUPS_REPEATED_PARAMETER = "A parameter can only appear once in groups."
TOO_MANY_BACKWARD_PASSES = (
    "Gradients were computed more than backward_passes_per_step times before call to step(). "
    "Increase backward_passes_per_step to accumulate gradients locally.")
STEP_AFTER_SYNCHRONIZE = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
    "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in your "
    "code.")
ZERO_GRAD_RACE = (
    "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
    "optimizer.synchronize(). This is prohibited as it can cause a race condition.")
PREDIVIDE_NEEDS_AVERAGE = "gradient_predivide_factor not supported with op != Average"
BACKWARD_PASSES_POSITIVE = "backward_passes_per_step must be > 0"
NUM_GROUPS_DEPRECATED = ("Parameter `num_groups` has been replaced by `groups` and will be "
                         "removed in v0.23.0.")
INVALID_PARAMS_TYPE = "invalid params of type: {}"
LBFGS_STATE = "cannot broadcast torch.optim.LBFGS state"
SYNC_BATCH_NORM_INPUT_DIM = "expected at least 2D input (got {}D input)"

# ---- TensorFlow frontend -----------------------------------------------------------------
IS_ADASUM_UNSUPPORTED = ("The Adasum reduction does not currently support sparse tensors. As a "
                         "workaround please pass sparse_as_dense=True to DistributedOptimizer")
IS_OPS_SUPPORTED = "Only Sum and Average ops are supported with tf.IndexedSlices"
IS_SCALING_UNSUPPORTED = "Pre/postscale_factor are not supported with tf.IndexedSlices"
GROUPS_TYPE_TF = ("groups should be a non-negative integer or a list of list of "
                  "tf.Variable.")
LOCAL_LAYERS_TYPE = "All local layers must be of tf.keras.layers.Layer type."
SYNC_BATCH_NORM_FUSED = "SyncBatchNormalization does not support fused=True."

# ---- Keras frontend ----------------------------------------------------------------------
KERAS_OPS_SUPPORTED = "op currently only supports Average and Sum"
SPARSE_WITH_BACKWARD_PASSES = ("IndexedSlices are not supported when "
                               "`backward_passes_per_step` > 1 and `sparse_as_dense` is False.")
LOCAL_VARIABLES_TYPE = "All local variables must be of tf.Variable type."
INITIAL_LR_REQUIRED = "Parameter `initial_lr` is required"
STEPS_PER_EPOCH_UNKNOWN = (
    "Could not autodetect the number of steps per epoch. Please specify the steps_per_epoch "
    "parameter to the {}() or upgrade to the latest version of Keras.")
WARMUP_FINISHED = "\nEpoch {}: finished gradual learning rate warmup to {:g}."
