/*
 * ck_save_ctx(struct ck_jmpctx *ctx): a setjmp that records exactly what the
 * restorer's ck_jump_ctx loads back (callee-saved registers, stack pointer,
 * return address, MXCSR and the x87 control word).  Returns 0 when called;
 * "returns" 1 in the restored process.  Offsets follow struct ck_jmpctx.
 */
    .text
    .globl ck_save_ctx
    .hidden ck_save_ctx
    .type ck_save_ctx, @function
ck_save_ctx:
    movq %rbx, 0(%rdi)
    movq %rbp, 8(%rdi)
    movq %r12, 16(%rdi)
    movq %r13, 24(%rdi)
    movq %r14, 32(%rdi)
    movq %r15, 40(%rdi)
    leaq 8(%rsp), %rdx
    movq %rdx, 48(%rdi)
    movq (%rsp), %rdx
    movq %rdx, 56(%rdi)
    stmxcsr 64(%rdi)
    movl $0, 68(%rdi)
    fnstcw 68(%rdi)
    xorl %eax, %eax
    ret
    .size ck_save_ctx, .-ck_save_ctx

/*
 * Signal return trampoline for handlers installed with the raw rt_sigaction
 * (glibc's own __restore_rt is not exported).  Same bytes as glibc's, so
 * debuggers still recognise signal frames.
 */
    .text
    .globl ck_sigreturn_trampoline
    .hidden ck_sigreturn_trampoline
    .type ck_sigreturn_trampoline, @function
ck_sigreturn_trampoline:
    movq $15, %rax
    syscall
    hlt
    .size ck_sigreturn_trampoline, .-ck_sigreturn_trampoline

    .section .note.GNU-stack, "", @progbits
