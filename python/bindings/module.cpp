// strideweave._core: the nanobind module. One bind_* function per area.
#include "common.hpp"
#include "strideweave/completion.hpp"

namespace swpy { void bind_checkpoint(nb::module_& m); }  // checkpoint.cpp
// views: narrow, chunk, permute, reshape
namespace swpy { void bind_views(nb::module_& m); }  // views.cpp
// optimizers on tiled parameters
namespace swpy { void bind_optim(nb::module_& m); }  // optim.cpp
// sparse MoE block
namespace swpy { void bind_moe(nb::module_& m); }  // moe.cpp

NB_MODULE(_core, m) {
  m.doc() = "StrideWeave engine (C++20). Import `strideweave`, not this module.";
  // DType singletons live as class attributes for the life of the process; the
  // type <-> instance cycle is intended, so the exit-time leak report is noise.
  nb::set_leak_warnings(false);
  swpy::remember_main_thread();
  swpy::bind_errors(m);
  swpy::bind_dtype(m);
  swpy::bind_layout(m);
  swpy::bind_carriers(m);
  swpy::bind_tensor(m);
  swpy::bind_dlpack(m);
  swpy::bind_completion(m);
  swpy::bind_extension(m);
  swpy::bind_ops(m);
  swpy::bind_tiled(m);
  swpy::bind_tensor_operators(m);
  swpy::bind_checkpoint(m);
  // views: narrow, chunk, permute, reshape
  swpy::bind_views(m);
  // optimizers on tiled parameters
  swpy::bind_optim(m);
  // sparse MoE block
  swpy::bind_moe(m);
  // Note [Drain at exit] (completion.hpp): let pool threads drop their references to
  // Python-owned objects before finalization. Bounded, so work that never completes
  // (a transfer nobody finishes) cannot hang the exit.
  nb::module_::import_("atexit").attr("register")(nb::cpp_function([] {
    swpy::GilRelease nogil;
    for (sw::Executor* e : {&sw::Executor::moves(), &sw::Executor::io(), &sw::Executor::device_reads(), &sw::Executor::select()})
      e->wait_idle(std::chrono::seconds(10));
    swpy::settle_threads_at_exit();  // Note [Threads at interpreter exit] (common.hpp)
  }));
}
