// Standalone timing of SwiGLU backward variants (bf16, R = 131072 x H = 2048), cudaEvent,
// median of 20 after 5 warm-ups; prints us and TB/s (5 arrays moved) per variant. Not part of
// the library: the experiment behind kRowUnroll in kernels/swiglu.cu (docs/kernels.md).
//   nvcc -O3 -arch=sm_90a -std=c++17 -o /tmp/swb benchmarks/swiglu_bwd_variants.cu && /tmp/swb
#include <cuda_bf16.h>
#include <cstdio>
#include <vector>
#include <algorithm>
#include <cstdint>
struct alignas(16) V8 { __nv_bfloat16 v[8]; };
__device__ __forceinline__ float f(__nv_bfloat16 x){return __bfloat162float(x);}
__device__ __forceinline__ __nv_bfloat16 b(float x){return __float2bfloat16_rn(x);}
__device__ __forceinline__ float sg(float g){return __fdividef(1.f,1.f+__expf(-g));}
template<bool CS> __device__ __forceinline__ V8 ld(const V8* p){ if(CS){uint4 u=__ldcs(reinterpret_cast<const uint4*>(p)); return *reinterpret_cast<V8*>(&u);} return *p;}
template<bool CS> __device__ __forceinline__ void st(V8* p, const V8& v){ if(CS){__stcs(reinterpret_cast<uint4*>(p), *reinterpret_cast<const uint4*>(&v));} else *p=v;}
__device__ __forceinline__ void math(const V8&g,const V8&u,const V8&d,float wr,V8&dg,V8&du,float&acc){
#pragma unroll
 for(int j=0;j<8;++j){float x=f(g.v[j]),y=f(u.v[j]),dy=f(d.v[j]);float s=sg(x),si=x*s;acc+=dy*si*y;float dyw=dy*wr;dg.v[j]=b(dyw*y*(s*(1.f+x*(1.f-s))));du.v[j]=b(dyw*si);}
}
// flat, U vectors per thread, one shot
template<int U,bool CS> __global__ void __launch_bounds__(256) flat(const V8*g,const V8*u,const V8*d,V8*dg,V8*du,int64_t n){
 int64_t base=(int64_t)blockIdx.x*256*U+threadIdx.x; V8 G[U],Uu[U],D[U];
#pragma unroll
 for(int q=0;q<U;++q){int64_t i=base+q*256; if(i<n){G[q]=ld<CS>(g+i);Uu[q]=ld<CS>(u+i);D[q]=ld<CS>(d+i);}}
#pragma unroll
 for(int q=0;q<U;++q){int64_t i=base+q*256; if(i<n){V8 a,c; float acc=0; math(G[q],Uu[q],D[q],1.f,a,c,acc); st<CS>(dg+i,a); st<CS>(du+i,c);}}
}
// persistent grid-stride, U per iteration
template<int U,bool CS> __global__ void __launch_bounds__(256) gs(const V8*g,const V8*u,const V8*d,V8*dg,V8*du,int64_t n){
 for(int64_t base=(int64_t)blockIdx.x*256*U+threadIdx.x; base<n; base+=(int64_t)gridDim.x*256*U){ V8 G[U],Uu[U],D[U];
#pragma unroll
 for(int q=0;q<U;++q){int64_t i=base+q*256; if(i<n){G[q]=ld<CS>(g+i);Uu[q]=ld<CS>(u+i);D[q]=ld<CS>(d+i);}}
#pragma unroll
 for(int q=0;q<U;++q){int64_t i=base+q*256; if(i<n){V8 a,c; float acc=0; math(G[q],Uu[q],D[q],1.f,a,c,acc); st<CS>(dg+i,a); st<CS>(du+i,c);}}
 }
}
// weighted: warp per row (current)
__global__ void __launch_bounds__(256) wrow(const V8*g,const V8*u,const float*w,const V8*d,V8*dg,V8*du,float*dw,int64_t rows,int64_t nv){
 int lane=threadIdx.x&31;
 for(int64_t r=(int64_t)blockIdx.x*8+(threadIdx.x>>5);r<rows;r+=(int64_t)gridDim.x*8){float wr=w[r];float acc=0;
  for(int64_t i=lane;i<nv;i+=32){V8 a,c;math(g[r*nv+i],u[r*nv+i],d[r*nv+i],wr,a,c,acc);dg[r*nv+i]=a;du[r*nv+i]=c;}
  for(int o=16;o>0;o>>=1)acc+=__shfl_xor_sync(0xffffffffu,acc,o); if(lane==0)dw[r]=acc;}
}
// weighted: warp per row, loads of U iterations first (nv/32 multiple of U assumed here: 8)
template<int U,bool CS> __global__ void __launch_bounds__(256) wrowu(const V8*g,const V8*u,const float*w,const V8*d,V8*dg,V8*du,float*dw,int64_t rows,int64_t nv){
 int lane=threadIdx.x&31;
 for(int64_t r=(int64_t)blockIdx.x*8+(threadIdx.x>>5);r<rows;r+=(int64_t)gridDim.x*8){float wr=w[r];float acc=0;
  for(int64_t i0=lane;i0<nv;i0+=32*U){V8 G[U],Uu[U],D[U];
#pragma unroll
   for(int q=0;q<U;++q){int64_t i=i0+q*32; if(i<nv){G[q]=ld<CS>(g+r*nv+i);Uu[q]=ld<CS>(u+r*nv+i);D[q]=ld<CS>(d+r*nv+i);}}
#pragma unroll
   for(int q=0;q<U;++q){int64_t i=i0+q*32; if(i<nv){V8 a,c;math(G[q],Uu[q],D[q],wr,a,c,acc);st<CS>(dg+r*nv+i,a);st<CS>(du+r*nv+i,c);}}}
  for(int o=16;o>0;o>>=1)acc+=__shfl_xor_sync(0xffffffffu,acc,o); if(lane==0)dw[r]=acc;}
}
// flat with a W-element vector (W = 4: 8-byte accesses, XLA's loop fusion shape: one vector per
// thread, 128-thread blocks), U vectors per thread, THREADS per block
template<int W> struct alignas(2*W) VW { __nv_bfloat16 v[W]; };
template<int W,int U,int THREADS> __global__ void __launch_bounds__(THREADS) flatw(const VW<W>*g,const VW<W>*u,const VW<W>*d,VW<W>*dg,VW<W>*du,int64_t n){
 int64_t base=(int64_t)blockIdx.x*THREADS*U+threadIdx.x; VW<W> G[U],Uu[U],D[U];
#pragma unroll
 for(int q=0;q<U;++q){int64_t i=base+q*THREADS; if(i<n){G[q]=g[i];Uu[q]=u[i];D[q]=d[i];}}
#pragma unroll
 for(int q=0;q<U;++q){int64_t i=base+q*THREADS; if(i<n){VW<W> a,c;
#pragma unroll
  for(int j=0;j<W;++j){float x=f(G[q].v[j]),y=f(Uu[q].v[j]),dy=f(D[q].v[j]);float s=sg(x);a.v[j]=b(dy*y*(s*(1.f+x*(1.f-s))));c.v[j]=b(dy*(x*s));}
  dg[i]=a;du[i]=c;}}
}
// weighted, warp per row, W-element vectors, loads of U iterations first (nv/32 multiple of U)
template<int W,int U> __global__ void __launch_bounds__(256) wroww(const VW<W>*g,const VW<W>*u,const float*w,const VW<W>*d,VW<W>*dg,VW<W>*du,float*dw,int64_t rows,int64_t nv){
 int lane=threadIdx.x&31;
 for(int64_t r=(int64_t)blockIdx.x*8+(threadIdx.x>>5);r<rows;r+=(int64_t)gridDim.x*8){float wr=w[r];float acc=0;
  for(int64_t i0=lane;i0<nv;i0+=32*U){VW<W> G[U],Uu[U],D[U];
#pragma unroll
   for(int q=0;q<U;++q){int64_t i=i0+q*32; if(i<nv){G[q]=g[r*nv+i];Uu[q]=u[r*nv+i];D[q]=d[r*nv+i];}}
#pragma unroll
   for(int q=0;q<U;++q){int64_t i=i0+q*32; if(i<nv){VW<W> a,c;
#pragma unroll
    for(int j=0;j<W;++j){float x=f(G[q].v[j]),y=f(Uu[q].v[j]),dy=f(D[q].v[j]);float s=sg(x),si=x*s;acc+=dy*si*y;float dyw=dy*wr;a.v[j]=b(dyw*y*(s*(1.f+x*(1.f-s))));c.v[j]=b(dyw*si);}
    dg[r*nv+i]=a;du[r*nv+i]=c;}}}
  for(int o=16;o>0;o>>=1)acc+=__shfl_xor_sync(0xffffffffu,acc,o); if(lane==0)dw[r]=acc;}
}
// weighted, one block of THREADS per row, W-element vectors, U per thread (loads first), then a
// block reduction of dw (nv == THREADS * U assumed)
template<int W,int U,int THREADS> __global__ void __launch_bounds__(THREADS) wblock(const VW<W>*g,const VW<W>*u,const float*w,const VW<W>*d,VW<W>*dg,VW<W>*du,float*dw,int64_t rows,int64_t nv){
 __shared__ float part[THREADS/32];
 const int64_t r=blockIdx.x; const float wr=w[r]; float acc=0; VW<W> G[U],Uu[U],D[U];
#pragma unroll
 for(int q=0;q<U;++q){int64_t i=threadIdx.x+q*THREADS; G[q]=g[r*nv+i];Uu[q]=u[r*nv+i];D[q]=d[r*nv+i];}
#pragma unroll
 for(int q=0;q<U;++q){int64_t i=threadIdx.x+q*THREADS; VW<W> a,c;
#pragma unroll
  for(int j=0;j<W;++j){float x=f(G[q].v[j]),y=f(Uu[q].v[j]),dy=f(D[q].v[j]);float s=sg(x),si=x*s;acc+=dy*si*y;float dyw=dy*wr;a.v[j]=b(dyw*y*(s*(1.f+x*(1.f-s))));c.v[j]=b(dyw*si);}
  dg[r*nv+i]=a;du[r*nv+i]=c;}
 for(int o=16;o>0;o>>=1)acc+=__shfl_xor_sync(0xffffffffu,acc,o);
 if((threadIdx.x&31)==0)part[threadIdx.x>>5]=acc; __syncthreads();
 if(threadIdx.x<32){acc=threadIdx.x<THREADS/32?part[threadIdx.x]:0.f; for(int o=16;o>0;o>>=1)acc+=__shfl_xor_sync(0xffffffffu,acc,o); if(threadIdx.x==0)dw[r]=acc;}
}
__global__ void copy5(const uint4*a,const uint4*b2,const uint4*c,uint4*x,uint4*y,int64_t n){for(int64_t i=(int64_t)blockIdx.x*blockDim.x+threadIdx.x;i<n;i+=(int64_t)gridDim.x*blockDim.x){uint4 p=a[i],q=b2[i],r=c[i];x[i]=make_uint4(p.x^q.x,p.y^r.y,p.z,q.w);y[i]=make_uint4(r.x,q.y,p.z^r.z,p.w);}}
template<class F> float timeit(F fn){cudaEvent_t a,b2;cudaEventCreate(&a);cudaEventCreate(&b2);std::vector<float> t;for(int k=0;k<25;++k){cudaEventRecord(a);fn();cudaEventRecord(b2);cudaEventSynchronize(b2);float ms;cudaEventElapsedTime(&ms,a,b2);if(k>=5)t.push_back(ms);}std::sort(t.begin(),t.end());return t[t.size()/2]*1000.f;}
int main(){
 const int64_t R=131072,H=2048,n=R*H/8; size_t bytes=R*H*2;
 V8*g,*u,*d,*dg,*du; float*w,*dw; cudaMalloc(&g,bytes);cudaMalloc(&u,bytes);cudaMalloc(&d,bytes);cudaMalloc(&dg,bytes);cudaMalloc(&du,bytes);cudaMalloc(&w,R*4);cudaMalloc(&dw,R*4);
 cudaMemset(g,0x3c,bytes);cudaMemset(u,0x3d,bytes);cudaMemset(d,0x3e,bytes);cudaMemset(w,0,R*4);
 double gb=5.0*bytes/1e9;
 auto rep=[&](const char*name,float us){printf("%-28s %8.1f us  %6.2f TB/s\n",name,us,gb*1e3/us);};
 int sms=132;
 rep("copy5 (3 in, 2 out)",timeit([&]{copy5<<<sms*16,256>>>((uint4*)g,(uint4*)u,(uint4*)d,(uint4*)dg,(uint4*)du,n);}));
 {const int64_t n4=R*H/4; using P=VW<4>*; using CP=const VW<4>*;
  rep("XLA shape: 8B x1, 128 thr",timeit([&]{flatw<4,1,128><<<(n4+127)/128,128>>>((CP)g,(CP)u,(CP)d,(P)dg,(P)du,n4);}));
  rep("8B x1, 256 thr",timeit([&]{flatw<4,1,256><<<(n4+255)/256,256>>>((CP)g,(CP)u,(CP)d,(P)dg,(P)du,n4);}));
  rep("8B x2, 128 thr",timeit([&]{flatw<4,2,128><<<(n4+255)/256,128>>>((CP)g,(CP)u,(CP)d,(P)dg,(P)du,n4);}));
  rep("8B x4, 256 thr",timeit([&]{flatw<4,4,256><<<(n4+1023)/1024,256>>>((CP)g,(CP)u,(CP)d,(P)dg,(P)du,n4);}));
  using P8=VW<8>*; using CP8=const VW<8>*;
  rep("16B x1, 128 thr",timeit([&]{flatw<8,1,128><<<(n+127)/128,128>>>((CP8)g,(CP8)u,(CP8)d,(P8)dg,(P8)du,n);}));
  rep("16B x2, 128 thr",timeit([&]{flatw<8,2,128><<<(n+255)/256,128>>>((CP8)g,(CP8)u,(CP8)d,(P8)dg,(P8)du,n);}));
  rep("16B x4, 128 thr",timeit([&]{flatw<8,4,128><<<(n+511)/512,128>>>((CP8)g,(CP8)u,(CP8)d,(P8)dg,(P8)du,n);}));
  rep("16B x4, 256 thr (flatw)",timeit([&]{flatw<8,4,256><<<(n+1023)/1024,256>>>((CP8)g,(CP8)u,(CP8)d,(P8)dg,(P8)du,n);}));
  rep("4B x1, 128 thr",timeit([&]{flatw<2,1,128><<<(R*H/2+127)/128,128>>>((const VW<2>*)g,(const VW<2>*)u,(const VW<2>*)d,(VW<2>*)dg,(VW<2>*)du,R*H/2);}));}
 rep("flat U4 (current)",timeit([&]{flat<4,false><<<(n+1023)/1024,256>>>(g,u,d,dg,du,n);}));
 rep("flat U4 cs",timeit([&]{flat<4,true><<<(n+1023)/1024,256>>>(g,u,d,dg,du,n);}));
 rep("flat U2",timeit([&]{flat<2,false><<<(n+511)/512,256>>>(g,u,d,dg,du,n);}));
 rep("flat U2 cs",timeit([&]{flat<2,true><<<(n+511)/512,256>>>(g,u,d,dg,du,n);}));
 rep("flat U8",timeit([&]{flat<8,false><<<(n+2047)/2048,256>>>(g,u,d,dg,du,n);}));
 rep("flat U1",timeit([&]{flat<1,false><<<(n+255)/256,256>>>(g,u,d,dg,du,n);}));
 for(int m: {4,8,16,32}){char nm[64];snprintf(nm,64,"gs U4 grid=%dxSM",m);rep(nm,timeit([&]{gs<4,false><<<sms*m,256>>>(g,u,d,dg,du,n);}));snprintf(nm,64,"gs U4 cs grid=%dxSM",m);rep(nm,timeit([&]{gs<4,true><<<sms*m,256>>>(g,u,d,dg,du,n);}));snprintf(nm,64,"gs U2 grid=%dxSM",m);rep(nm,timeit([&]{gs<2,false><<<sms*m,256>>>(g,u,d,dg,du,n);}));}
 int64_t nv=H/8; int wg=std::min<int64_t>((R+7)/8,1<<20);
 rep("w: warp/row (current)",timeit([&]{wrow<<<wg,256>>>(g,u,w,d,dg,du,dw,R,nv);}));
 rep("w: warp/row U4",timeit([&]{wrowu<4,false><<<wg,256>>>(g,u,w,d,dg,du,dw,R,nv);}));
 rep("w: warp/row U8",timeit([&]{wrowu<8,false><<<wg,256>>>(g,u,w,d,dg,du,dw,R,nv);}));
 rep("w: warp/row U4 cs",timeit([&]{wrowu<4,true><<<wg,256>>>(g,u,w,d,dg,du,dw,R,nv);}));
 rep("w: warp/row U8 cs",timeit([&]{wrowu<8,true><<<wg,256>>>(g,u,w,d,dg,du,dw,R,nv);}));
 for(int m:{8,16,32}){char nm[64];snprintf(nm,64,"w: U8 grid=%dxSM",m);rep(nm,timeit([&]{wrowu<8,false><<<sms*m,256>>>(g,u,w,d,dg,du,dw,R,nv);}));}
 {using P=VW<4>*; using CP=const VW<4>*; int64_t nv4=H/4;
  rep("w: warp/row 8B U16",timeit([&]{wroww<4,16><<<wg,256>>>((CP)g,(CP)u,w,(CP)d,(P)dg,(P)du,dw,R,nv4);}));
  rep("w: warp/row 8B U8",timeit([&]{wroww<4,8><<<wg,256>>>((CP)g,(CP)u,w,(CP)d,(P)dg,(P)du,dw,R,nv4);}));
  rep("w: warp/row 16B U8 (generic)",timeit([&]{wroww<8,8><<<wg,256>>>((const VW<8>*)g,(const VW<8>*)u,w,(const VW<8>*)d,(VW<8>*)dg,(VW<8>*)du,dw,R,nv);}));}
 {using P=VW<4>*; using CP=const VW<4>*; int64_t nv4=H/4;
  rep("w: block/row 8B 512thr x1",timeit([&]{wblock<4,1,512><<<R,512>>>((CP)g,(CP)u,w,(CP)d,(P)dg,(P)du,dw,R,nv4);}));
  rep("w: block/row 8B 256thr x2",timeit([&]{wblock<4,2,256><<<R,256>>>((CP)g,(CP)u,w,(CP)d,(P)dg,(P)du,dw,R,nv4);}));
  rep("w: block/row 8B 128thr x4",timeit([&]{wblock<4,4,128><<<R,128>>>((CP)g,(CP)u,w,(CP)d,(P)dg,(P)du,dw,R,nv4);}));
  rep("w: block/row 16B 256thr x1",timeit([&]{wblock<8,1,256><<<R,256>>>((const VW<8>*)g,(const VW<8>*)u,w,(const VW<8>*)d,(VW<8>*)dg,(VW<8>*)du,dw,R,nv);}));
  rep("w: block/row 16B 128thr x2",timeit([&]{wblock<8,2,128><<<R,128>>>((const VW<8>*)g,(const VW<8>*)u,w,(const VW<8>*)d,(VW<8>*)dg,(VW<8>*)du,dw,R,nv);}));
  rep("w: warp/row U8 (current), again",timeit([&]{wrowu<8,false><<<wg,256>>>(g,u,w,d,dg,du,dw,R,nv);}));}
 rep("flat U4 (current), again",timeit([&]{flat<4,false><<<(n+1023)/1024,256>>>(g,u,d,dg,du,n);}));
 cudaError_t e=cudaDeviceSynchronize(); printf("status %s\n",cudaGetErrorString(e));
}
