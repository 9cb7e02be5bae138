// Internal to io/: the submission bookkeeping of the "uring" backend (uring_backend.cc), a pure
// function so that it can be tested without a kernel.
#pragma once

namespace strata::io::internal {

// How many of the `prepared` entries (those prepared since the last submit that took any) a
// non-negative result `r` of io_uring_submit / io_uring_submit_and_wait hands to the kernel.
//
// Without SQPOLL the system call consumes entries and r counts them; entries it did not take stay
// in the submission queue for the next call: min(r, prepared).
//
// With IORING_SETUP_SQPOLL, liburing publishes the queue's tail and returns tail - khead (read
// after the store, usually without a system call): the entries the kernel's polling thread has not
// consumed yet. That counts entries of earlier calls again (r > prepared) and misses those the
// thread consumed between the store and the read (r < prepared, r == 0). Once the tail is
// published every entry belongs to the kernel and will complete: all of `prepared`, whatever r.
unsigned EntriesTaken(int r, unsigned prepared, bool sqpoll);

}  // namespace strata::io::internal
