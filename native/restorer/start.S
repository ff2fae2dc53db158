/*
 * Entry point and the few things C cannot express: switching stacks,
 * starting a thread with clone3, and jumping to a saved resume point.
 */
    .text
    .globl _start
    .type _start, @function
_start:
    xorl %ebp, %ebp
    movq %rsp, %rdi          /* argc, argv[], envp[], auxv on the stack */
    andq $-16, %rsp
    call rst_main
    hlt
    .size _start, .-_start

/* rst_switch_stack(stack_top, fn, arg): run fn(arg) on a new stack */
    .globl rst_switch_stack
    .type rst_switch_stack, @function
rst_switch_stack:
    movq %rdi, %rsp
    andq $-16, %rsp
    movq %rdx, %rdi
    xorl %ebp, %ebp
    call *%rsi
    hlt
    .size rst_switch_stack, .-rst_switch_stack

/*
 * rst_clone3_thread(args, size, fn, t): clone3; the child calls fn(t) on the
 * stack given in args and never returns.  fn and t ride in callee-saved
 * registers, which the child inherits.
 */
    .globl rst_clone3_thread
    .type rst_clone3_thread, @function
rst_clone3_thread:
    pushq %r12
    pushq %r13
    movq %rdx, %r12
    movq %rcx, %r13
    movl $435, %eax          /* SYS_clone3 */
    syscall
    testq %rax, %rax
    jnz 1f
    xorl %ebp, %ebp
    movq %r13, %rdi
    andq $-16, %rsp
    call *%r12
    hlt
1:
    popq %r13
    popq %r12
    ret
    .size rst_clone3_thread, .-rst_clone3_thread

/*
 * rst_jump_ctx(ctx): load a struct ck_jmpctx saved by the shim's
 * ck_save_ctx and continue there, making it return 1.
 */
    .globl rst_jump_ctx
    .type rst_jump_ctx, @function
rst_jump_ctx:
    ldmxcsr 64(%rdi)
    fldcw 68(%rdi)
    movq 0(%rdi), %rbx
    movq 8(%rdi), %rbp
    movq 16(%rdi), %r12
    movq 24(%rdi), %r13
    movq 32(%rdi), %r14
    movq 40(%rdi), %r15
    movq 48(%rdi), %rsp
    movl $1, %eax
    jmpq *56(%rdi)
    .size rst_jump_ctx, .-rst_jump_ctx

    .section .note.GNU-stack, "", @progbits
