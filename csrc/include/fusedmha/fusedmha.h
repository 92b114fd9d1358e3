#pragma once

// The whole public C++ API of fusedmha.
#include <fusedmha/attention.h>
#include <fusedmha/build_info.h>
#include <fusedmha/flex.h>
#include <fusedmha/macros.h>
#include <fusedmha/multihead_attention.h>
