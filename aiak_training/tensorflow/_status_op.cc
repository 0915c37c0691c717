// AiakCheckStatus: an op that fails with a given TensorFlow status code and message.
//
// Graph collectives run as tf.py_function ops, and TensorFlow reports every Python error
// of such an op as UNKNOWN (ValueError as INVALID_ARGUMENT).  Horovod's own C++ ops fail a
// mismatch between ranks with FAILED_PRECONDITION, and TF1-style code catches that class.
// The collective's Python body therefore hands its error on as (code, message) outputs,
// and this op, which runs right after it, turns them into the op's status.
#include <string>

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace aiak_training {

REGISTER_OP("AiakCheckStatus")
    .Input("code: int32")
    .Input("message: string")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::NoOutputs);

class AiakCheckStatusOp : public tensorflow::OpKernel {
 public:
  explicit AiakCheckStatusOp(tensorflow::OpKernelConstruction* context)
      : tensorflow::OpKernel(context) {}

  void Compute(tensorflow::OpKernelContext* context) override {
    const int code = context->input(0).scalar<tensorflow::int32>()();
    if (code == 0) return;  // the collective succeeded
    const tensorflow::tstring& message = context->input(1).scalar<tensorflow::tstring>()();
    context->SetStatus(absl::Status(static_cast<absl::StatusCode>(code),
                                    std::string(message.data(), message.size())));
  }
};

REGISTER_KERNEL_BUILDER(Name("AiakCheckStatus").Device(tensorflow::DEVICE_CPU),
                        AiakCheckStatusOp);

}  // namespace aiak_training
