// A thread of its own for one piece of work at a time, so that the Python thread that hands it over can go on
// meanwhile: the expert tier starts a window's CPU pool run here, queues the staging copies of the same window
// while the pool computes, then waits for the run (`finish`). The thread is made on first use (again in a
// process forked after it was made, which has no copy of it), spins a short while after each run for the next
// one (a decode window's tiered layers come a few hundred microseconds apart) and then sleeps until one comes.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <unistd.h>

class BackgroundRuns {
public:
    // Hand `run` to the thread; it must not be running one already (finish that first).
    void start(std::function<void()> run) {
        if (state_.load(std::memory_order_acquire) != IDLE) {
            throw std::logic_error("a background run is still going: finish it before starting another");
        }
        ensure_thread();
        {
            std::lock_guard<std::mutex> lock(mutex_);
            run_ = std::move(run);
            error_ = nullptr;
            state_.store(POSTED, std::memory_order_release);
        }
        wake_.notify_one();
    }

    // Wait for the run started last; returns the seconds it took on the thread, or throws what it threw.
    double finish() {
        if (state_.load(std::memory_order_acquire) == IDLE) throw std::logic_error("no background run to finish");
        const auto until = std::chrono::steady_clock::now() + FINISH_SPIN;
        while (state_.load(std::memory_order_acquire) != DONE && std::chrono::steady_clock::now() < until) {
            std::this_thread::yield();
        }
        {
            std::unique_lock<std::mutex> lock(mutex_);
            done_.wait(lock, [this] { return state_.load(std::memory_order_acquire) == DONE; });
        }
        std::exception_ptr error = error_;
        error_ = nullptr;
        state_.store(IDLE, std::memory_order_release);
        if (error) std::rethrow_exception(error);
        return seconds_;
    }

private:
    enum State { IDLE, POSTED, DONE };
    static constexpr auto SPIN = std::chrono::milliseconds(2);  // how long the thread looks for the next run
    // how long `finish` looks for the run's end before it sleeps, leaving its core to the pool's threads
    static constexpr auto FINISH_SPIN = std::chrono::microseconds(20);

    void ensure_thread() {
        if (owner_ == getpid()) return;
        owner_ = getpid();
        std::thread(&BackgroundRuns::loop, this).detach();  // lives as long as the process
    }

    void loop() {
        for (;;) {
            const auto until = std::chrono::steady_clock::now() + SPIN;
            while (state_.load(std::memory_order_acquire) != POSTED && std::chrono::steady_clock::now() < until) {
                std::this_thread::yield();
            }
            std::function<void()> run;
            {
                std::unique_lock<std::mutex> lock(mutex_);
                wake_.wait(lock, [this] { return state_.load(std::memory_order_acquire) == POSTED; });
                run = std::move(run_);
            }
            const auto began = std::chrono::steady_clock::now();
            try {
                run();
            } catch (...) {
                error_ = std::current_exception();
            }
            seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
            {
                std::lock_guard<std::mutex> lock(mutex_);
                state_.store(DONE, std::memory_order_release);
            }
            done_.notify_one();
        }
    }

    std::atomic<int> state_{IDLE};
    std::mutex mutex_;
    std::condition_variable wake_, done_;
    std::function<void()> run_;
    std::exception_ptr error_;
    double seconds_ = 0.0;
    pid_t owner_ = 0;  // the process whose thread this is
};
