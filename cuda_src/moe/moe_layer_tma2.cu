// The forward MoE kernel on clusters of two CTAs (engine "tma2", opt-in): the kernel of
// moe_layer_tma.cu with ws::kCluster = 2 -- tasks in pairs, two row blocks of one expert sharing
// the weight tile that the cluster's leader multicasts into both CTAs' rings (ws_pipeline.cuh,
// "cluster pairs").  Launched with cluster dims (2, 1, 1) and an even grid.  The backward stays
// on moe_layer_tma.cu for now.
#define MOK_CLUSTER 2
#include "moe/moe_layer_tma.cu"
